// Clean shutdown on SIGINT / SIGTERM for server processes: block the signals in
// every thread (call BlockTerminationSignals() first thing in main, before any
// thread starts), then park the main thread in WaitForTerminationSignal().
#ifndef TANDEM_COMMON_SIGNALS_H_
#define TANDEM_COMMON_SIGNALS_H_

namespace tandem {

void BlockTerminationSignals();
// Returns the signal number received (SIGINT or SIGTERM).
int WaitForTerminationSignal();

}  // namespace tandem

#endif  // TANDEM_COMMON_SIGNALS_H_
