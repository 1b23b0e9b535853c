// The flags prefill_main and decode_main share (the model, the server, the
// engine and its tensor parallelism, the UCX agent), defined once so the two
// workers cannot drift apart. Role-specific flags (--worker_id's default,
// landing pool, speculation, streaming) stay in each main.
#ifndef TANDEM_WORKER_WORKER_FLAGS_H_
#define TANDEM_WORKER_WORKER_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, served_model_name);
ABSL_DECLARE_FLAG(std::string, router);
ABSL_DECLARE_FLAG(std::string, host);
ABSL_DECLARE_FLAG(std::string, advertise_host);
ABSL_DECLARE_FLAG(int, port);
ABSL_DECLARE_FLAG(int, metrics_port);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int, block_size);
ABSL_DECLARE_FLAG(int, num_slots);
ABSL_DECLARE_FLAG(int, num_blocks);
ABSL_DECLARE_FLAG(int64_t, max_context_tokens);
ABSL_DECLARE_FLAG(int64_t, max_tokens_per_step);
ABSL_DECLARE_FLAG(int, tp);
ABSL_DECLARE_FLAG(std::string, tp_fail_rank_at_step);
ABSL_DECLARE_FLAG(std::string, ucx_tls);
ABSL_DECLARE_FLAG(bool, ucx_peer_failure_detection);

#endif  // TANDEM_WORKER_WORKER_FLAGS_H_
