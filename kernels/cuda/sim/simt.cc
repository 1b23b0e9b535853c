// The SIMT emulator (simt.h): fibers with their own stacks, a seeded scheduler
// per block, block and warp barriers, the warp exchange behind shuffles and votes.
//
// Context switches are a few instructions of x86-64 assembly (callee-saved
// registers, the stack pointer, MXCSR and the x87 control word), not swapcontext:
// glibc's swapcontext makes a system call per switch and the emulator switches at
// every barrier of every thread. Under AddressSanitizer every switch is announced
// with __sanitizer_start/finish_switch_fiber so ASan follows the stacks.
#include "kernels/cuda/sim/simt.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__)
#error "cuda_sim: the fiber switch is written for x86-64"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_SIM_ASAN 1
#endif
#endif

#if defined(TANDEM_SIM_ASAN)
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                    size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old);
void __asan_unpoison_memory_region(const volatile void* addr, size_t size);
}
#endif

// tandem_sim_switch(&from_sp, to_sp): saves the callee-saved state on the current
// stack, stores the stack pointer in *from_sp, and resumes the context whose
// stack pointer is to_sp.
extern "C" void tandem_sim_switch(void** from_sp, void* to_sp);
asm(R"(
  .text
  .globl tandem_sim_switch
  .type tandem_sim_switch,@function
tandem_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tandem_sim_switch,.-tandem_sim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace cuda_sim {
namespace {

constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultSmemLimit = 48 << 10;
constexpr size_t kMaxSmemOptIn = 227 << 10;
constexpr size_t kMaxStaticSmem = 48 << 10;  // per kernel, at compile time
constexpr size_t kSlotBytes = 64;
#if defined(TANDEM_SIM_ASAN)
constexpr size_t kStackBytes = 512 << 10;
#else
constexpr size_t kStackBytes = 128 << 10;
#endif

enum class FiberState { kRunnable, kBlockBarrier, kWarpBarrier, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address (above the guard page)
  ThreadState st;
  FiberState state = FiberState::kRunnable;
  // The slots of this lane's last warp collective (shared by its group; kept
  // alive until the lane's next collective).
  std::shared_ptr<unsigned char[]> xbuf;
  void* asan_fake = nullptr;
};

struct WarpGroup {  // one warp collective in progress
  unsigned mask = 0;
  unsigned arrived = 0;
  std::shared_ptr<unsigned char[]> slots;  // 32 lanes x kSlotBytes
};

struct Block;

// Per OS thread: the scheduler's context and the stack pool.
struct Worker {
  void* sched_sp = nullptr;
  Fiber* current = nullptr;
  Block* block = nullptr;
  std::vector<std::unique_ptr<Fiber>> pool;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake = nullptr;
};
thread_local Worker tl_worker;

struct Block {
  const std::function<void()>* body = nullptr;
  std::vector<Fiber*> fibers;
  std::vector<Fiber*> runnable;
  int live = 0;
  int at_barrier = 0;
  int barrier_values[2][3] = {};  // [generation parity][count, and, or]
  uint32_t barrier_generation = 0;
  // Per warp, the collectives in progress (disjoint masks).
  std::vector<std::vector<WarpGroup>> warp_groups;
  std::vector<unsigned char> dynamic_smem;
  // TANDEM_SHARED storage poisoned in this block, and its bytes.
  std::vector<void*> static_smem;
  size_t static_smem_bytes = 0;
  // Static and dynamic together: 48 KiB, or 227 KiB for a kernel that opted in.
  size_t smem_total_limit = 0;
  std::mt19937_64 rng;
  bool shuffle = true;
  std::string fault;
  uint64_t switches = 0;
};

std::atomic<uint64_t> g_seed{0};
std::atomic<bool> g_seed_set{false};
std::atomic<uint64_t> g_launches{0}, g_blocks{0}, g_threads{0}, g_switches{0};
std::mutex g_mu;
std::string g_last_error;                                    // guarded by g_mu
bool g_has_error = false;                                    // guarded by g_mu
std::unordered_map<const void*, size_t>& SmemAllowances() {  // guarded by g_mu
  static auto* m = new std::unordered_map<const void*, size_t>();
  return *m;
}

uint64_t CurrentSeed() {
  if (!g_seed_set.load()) {
    const char* env = std::getenv("TANDEM_SIM_SEED");
    g_seed.store(env != nullptr ? std::strtoull(env, nullptr, 10) : 1);
    g_seed_set.store(true);
  }
  return g_seed.load();
}

void RecordError(std::string message) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_has_error) {
    g_has_error = true;
    g_last_error = std::move(message);
  }
}

[[noreturn]] void FiberMain();

Fiber* NewFiber() {
  auto f = std::make_unique<Fiber>();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    std::fprintf(stderr, "cuda_sim: cannot map a fiber stack\n");
    std::abort();
  }
  mprotect(mem, page, PROT_NONE);  // guard page: a stack overflow faults
  f->stack = static_cast<char*>(mem) + page;
  Fiber* raw = f.get();
  tl_worker.pool.push_back(std::move(f));
  return raw;
}

// Prepares `f` so that switching to it enters FiberMain on a fresh stack. The
// restore half of tandem_sim_switch reads, from the saved stack pointer up:
// MXCSR and the x87 control word (16 bytes), r15 r14 r13 r12 rbx rbp, then the
// return address. The saved stack pointer is 16-aligned, so FiberMain starts with
// rsp = 8 (mod 16), as after a call.
void ResetFiber(Fiber* f) {
#if defined(TANDEM_SIM_ASAN)
  // The last run of this stack ended by switching away, never unwinding: its
  // frames' redzones are still poisoned.
  __asan_unpoison_memory_region(f->stack, kStackBytes);
#endif
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack + kStackBytes);
  top &= ~uintptr_t{15};
  uint64_t* slots = reinterpret_cast<uint64_t*>(top);
  slots[-1] = 0;  // FiberMain's own (never used) return address
  slots[-2] = reinterpret_cast<uint64_t>(&FiberMain);
  uint64_t* sp = slots - 10;
  for (int i = 0; i < 8; ++i) sp[i] = 0;  // control words, then rbp..r15 = 0
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(reinterpret_cast<char*>(sp), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  f->sp = sp;
  f->state = FiberState::kRunnable;
  f->xbuf.reset();
  f->st.cp_async.clear();
  f->st.cp_async_group = 0;
  f->asan_fake = nullptr;
}

// From the scheduler into fiber `f`; returns when the fiber switches back.
void SwitchToFiber(Fiber* f) {
  Worker& w = tl_worker;
  w.current = f;
  ++w.block->switches;
#if defined(TANDEM_SIM_ASAN)
  __sanitizer_start_switch_fiber(&w.sched_fake, f->stack, kStackBytes);
#endif
  tandem_sim_switch(&w.sched_sp, f->sp);
#if defined(TANDEM_SIM_ASAN)
  __sanitizer_finish_switch_fiber(w.sched_fake, nullptr, nullptr);
#endif
  w.current = nullptr;
}

// From the running fiber back to the scheduler.
void SwitchToScheduler(bool exiting) {
  Worker& w = tl_worker;
  Fiber* f = w.current;
#if defined(TANDEM_SIM_ASAN)
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f->asan_fake,
                                 w.sched_stack_bottom, w.sched_stack_size);
#else
  (void)exiting;
#endif
  tandem_sim_switch(&f->sp, w.sched_sp);
#if defined(TANDEM_SIM_ASAN)
  __sanitizer_finish_switch_fiber(f->asan_fake, &w.sched_stack_bottom,
                                  &w.sched_stack_size);
#endif
}

[[noreturn]] void FiberMain() {
  Worker& w = tl_worker;
#if defined(TANDEM_SIM_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &w.sched_stack_bottom, &w.sched_stack_size);
#endif
  (*w.block->body)();
  Fiber* f = w.current;
  Block* b = w.block;
  f->state = FiberState::kDone;
  --b->live;
  // A barrier that waited only for this thread can now complete.
  if (b->live > 0 && b->at_barrier == b->live) {
    // Release the block barrier (exited threads count as arrived).
    const int parity = b->barrier_generation & 1;
    b->barrier_values[parity ^ 1][0] = 0;
    b->barrier_values[parity ^ 1][1] = 1;
    b->barrier_values[parity ^ 1][2] = 0;
    ++b->barrier_generation;
    b->at_barrier = 0;
    for (Fiber* o : b->fibers) {
      if (o->state == FiberState::kBlockBarrier) {
        o->state = FiberState::kRunnable;
        b->runnable.push_back(o);
      }
    }
  }
  // A warp collective waiting on this lane can never complete: the scheduler
  // reports that as a deadlock when nothing is runnable.
  SwitchToScheduler(/*exiting=*/true);
  std::abort();  // never resumed
}

void Park() {  // the current fiber waits; someone else makes it runnable
  SwitchToScheduler(false);
}

void YieldNow() {
  Worker& w = tl_worker;
  w.block->runnable.push_back(w.current);
  SwitchToScheduler(false);
}

Fiber* PickRunnable(Block* b) {
  if (b->runnable.empty()) return nullptr;
  size_t i = 0;
  if (b->shuffle && b->runnable.size() > 1) {
    i = static_cast<size_t>(b->rng() % b->runnable.size());
  }
  Fiber* f = b->runnable[i];
  if (b->shuffle) {
    b->runnable[i] = b->runnable.back();
    b->runnable.pop_back();
  } else {
    b->runnable.erase(b->runnable.begin());
  }
  return f;
}

std::string DescribeDeadlock(const Block& b) {
  int at_block = 0, at_warp = 0;
  for (const Fiber* f : b.fibers) {
    at_block += f->state == FiberState::kBlockBarrier;
    at_warp += f->state == FiberState::kWarpBarrier;
  }
  return "deadlock: " + std::to_string(at_block) + " threads wait at __syncthreads, " +
         std::to_string(at_warp) + " at a warp collective, " + std::to_string(b.live) +
         " alive (a barrier some threads never reach)";
}

}  // namespace

ThreadState& Self() {
  Fiber* f = tl_worker.current;
  if (f == nullptr) {
    std::fprintf(stderr, "cuda_sim: a CUDA built-in used outside a kernel\n");
    std::abort();
  }
  return f->st;
}

void SetSeed(uint64_t seed) {
  g_seed.store(seed);
  g_seed_set.store(true);
}
uint64_t Seed() { return CurrentSeed(); }

Stats GetStats() {
  Stats s;
  s.launches = g_launches.load();
  s.blocks = g_blocks.load();
  s.threads = g_threads.load();
  s.switches = g_switches.load();
  return s;
}

const char* TakeLaunchError() {
  thread_local std::string taken;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_has_error) return nullptr;
  taken = g_last_error;
  g_has_error = false;
  g_last_error.clear();
  return taken.c_str();
}

const char* AllowDynamicSmemFor(const void* kernel, size_t bytes) {
  if (bytes > kMaxSmemOptIn) return "invalid argument: dynamic shared memory > 227 KiB";
  std::lock_guard<std::mutex> lock(g_mu);
  SmemAllowances()[kernel] = bytes;
  return nullptr;
}

const char* CheckDynamicSmemLimit(size_t bytes) {
  return bytes > kMaxSmemOptIn ? "invalid argument: dynamic shared memory > 227 KiB"
                               : nullptr;
}

void* DynamicShared() {
  Block* b = tl_worker.block;
  return b == nullptr || b->dynamic_smem.empty() ? nullptr : b->dynamic_smem.data();
}

void PoisonSharedBytes(void* p, size_t bytes) {
  Block* b = tl_worker.block;
  if (b == nullptr) return;
  if (std::find(b->static_smem.begin(), b->static_smem.end(), p) !=
      b->static_smem.end()) {
    return;
  }
  b->static_smem.push_back(p);
  b->static_smem_bytes += bytes;
  // As dynamic shared memory: all-ones reads as NaN in fp32 and bf16.
  std::memset(p, 0xFF, bytes);
  if (b->static_smem_bytes > kMaxStaticSmem) {
    Fault("static shared memory over 48 KiB (ptxas refuses such a kernel)");
  } else if (b->static_smem_bytes + b->dynamic_smem.size() > b->smem_total_limit) {
    Fault(b->smem_total_limit > kDefaultSmemLimit
              ? "too many resources requested for launch: static and dynamic shared "
                "memory over 227 KiB"
              : "too many resources requested for launch: static and dynamic shared "
                "memory over 48 KiB (the kernel did not opt in to more)");
  }
}

void Fault(const char* what) {
  Block* b = tl_worker.block;
  if (b != nullptr && b->fault.empty()) {
    const ThreadState& s = Self();
    b->fault = std::string(what) + " (block " + std::to_string(s.block_idx.x) + "," +
               std::to_string(s.block_idx.y) + "," + std::to_string(s.block_idx.z) +
               " thread " + std::to_string(s.linear) + ")";
  }
}

unsigned LiveLanes() {
  Block* b = tl_worker.block;
  const int warp = Self().warp;
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) {
    const size_t i = static_cast<size_t>(warp) * 32 + l;
    if (i < b->fibers.size() && b->fibers[i]->state != FiberState::kDone) m |= 1u << l;
  }
  return m;
}

bool RandomBit() {
  Block* b = tl_worker.block;
  return b != nullptr && b->shuffle && (b->rng() & 1u) != 0;
}

void Yield() {
  if (tl_worker.current != nullptr) YieldNow();
}

void SyncThreads() { (void)SyncThreadsReduce(0, 0); }

int SyncThreadsReduce(int value, int op) {
  Worker& w = tl_worker;
  Block* b = w.block;
  Fiber* f = w.current;
  const int parity = b->barrier_generation & 1;
  int* acc = b->barrier_values[parity];
  acc[0] += value;
  acc[1] = acc[1] && value;
  acc[2] = acc[2] || value;
  ++b->at_barrier;
  if (b->at_barrier == b->live) {
    int* next = b->barrier_values[parity ^ 1];
    next[0] = 0;
    next[1] = 1;
    next[2] = 0;
    ++b->barrier_generation;
    b->at_barrier = 0;
    for (Fiber* o : b->fibers) {
      if (o->state == FiberState::kBlockBarrier) {
        o->state = FiberState::kRunnable;
        b->runnable.push_back(o);
      }
    }
    YieldNow();  // let the others go first sometimes
  } else {
    f->state = FiberState::kBlockBarrier;
    Park();
  }
  return acc[op];
}

const unsigned char* WarpExchange(unsigned mask, const void* mine, size_t bytes) {
  Worker& w = tl_worker;
  Block* b = w.block;
  Fiber* f = w.current;
  const int lane = f->st.lane, warp = f->st.warp;
  if (((mask >> lane) & 1u) == 0) {
    Fault("warp collective called by a lane outside its mask");
    mask |= 1u << lane;
  }
  std::vector<WarpGroup>& groups = b->warp_groups[warp];
  size_t gi = groups.size();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].mask == mask) {
      gi = i;
    } else if (groups[i].mask & mask) {
      Fault("warp collectives with overlapping but different masks");
    }
  }
  if (gi == groups.size()) {
    const int lanes_here = std::min(32, static_cast<int>(b->fibers.size()) - warp * 32);
    if (lanes_here < 32 && (mask >> lanes_here) != 0) {
      Fault("warp collective mask names lanes that do not exist in this block");
    }
    WarpGroup g;
    g.mask = mask;
    g.slots.reset(new unsigned char[32 * kSlotBytes]());
    groups.push_back(std::move(g));
  }
  WarpGroup& g = groups[gi];
  if (bytes > 0) std::memcpy(g.slots.get() + lane * kSlotBytes, mine, bytes);
  g.arrived |= 1u << lane;
  if (g.arrived == mask) {
    for (int l = 0; l < 32; ++l) {
      if (((mask >> l) & 1u) == 0) continue;
      Fiber* o = b->fibers[static_cast<size_t>(warp) * 32 + l];
      o->xbuf = g.slots;
      if (l != lane && o->state == FiberState::kWarpBarrier) {
        o->state = FiberState::kRunnable;
        b->runnable.push_back(o);
      }
    }
    groups.erase(groups.begin() + static_cast<std::ptrdiff_t>(gi));
    YieldNow();
  } else {
    f->state = FiberState::kWarpBarrier;
    Park();
  }
  return f->xbuf.get();
}

namespace {
std::unordered_map<void*, Captured>& Captures() {  // guarded by g_mu
  static auto* m = new std::unordered_map<void*, Captured>();
  return *m;
}
}  // namespace

bool BeginCapture(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  return Captures().emplace(stream, Captured{}).second;
}

bool IsCapturing(void* stream) {
  if (stream == nullptr) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  return Captures().count(stream) != 0;
}

bool Record(void* stream, std::function<void()> op) {
  if (stream == nullptr) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Captures().find(stream);
  if (it == Captures().end()) return false;
  it->second.ops.push_back(std::move(op));
  return true;
}

void InvalidateCapture(void* stream, const std::string& why) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Captures().find(stream);
  if (it != Captures().end() && it->second.error.empty()) it->second.error = why;
}

Captured EndCapture(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Captures().find(stream);
  if (it == Captures().end()) {
    Captured c;
    c.error = "cuda_sim: EndCapture on a stream that is not capturing";
    return c;
  }
  Captured c = std::move(it->second);
  Captures().erase(it);
  return c;
}

void RecordLaunchError(const std::string& message) { RecordError(message); }

void Launch(const char* name, const void* kernel, dim3 grid, dim3 block,
            size_t dynamic_smem, void* stream, const std::function<void()>& body) {
  // Streams are in order and synchronous in the emulator: only capture matters.
  const bool capture = IsCapturing(stream);
  if (!capture) g_launches.fetch_add(1);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  auto fail = [&](const std::string& why) {
    RecordError(std::string("cuda_sim: launch of ") + name + ": " + why);
  };
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64) {
    fail("invalid configuration argument (block " + std::to_string(block.x) + "x" +
         std::to_string(block.y) + "x" + std::to_string(block.z) + ")");
    return;
  }
  if (grid.y > 65535 || grid.z > 65535) {
    fail("invalid configuration argument (grid y/z > 65535)");
    return;
  }
  if (blocks == 0) {
    fail("invalid configuration argument (empty grid)");
    return;
  }
  size_t smem_limit = kDefaultSmemLimit;
  bool opted_in = false;  // cudaFuncAttributeMaxDynamicSharedMemorySize was set
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = SmemAllowances().find(kernel);
    if (it != SmemAllowances().end()) {
      smem_limit = std::max(smem_limit, it->second);
      opted_in = true;
    }
  }
  if (dynamic_smem > smem_limit) {
    fail("too much dynamic shared memory (" + std::to_string(dynamic_smem) +
         " bytes; " + std::to_string(smem_limit) + " allowed for this kernel)");
    return;
  }
  Worker& w = tl_worker;
  if (w.block != nullptr) {
    fail("launch from inside a kernel (dynamic parallelism is not supported)");
    return;
  }
  if (capture) {
    // The replay launches the same kernel with the same (copied) arguments on no
    // stream: it runs when the graph is launched.
    std::function<void()> op = [name, kernel, grid, block, dynamic_smem,
                                body_copy = body]() {
      Launch(name, kernel, grid, block, dynamic_smem, nullptr, body_copy);
    };
    if (!Record(stream, std::move(op))) fail("stream capture ended during the launch");
    return;
  }
  const uint64_t seed = CurrentSeed();
  const uint64_t launch_no = g_launches.load();
  const int nthreads = static_cast<int>(threads);
  const int nwarps = (nthreads + 31) / 32;
  while (static_cast<int>(w.pool.size()) < nthreads) NewFiber();

  // Block order: a seeded permutation of the grid.
  std::vector<uint64_t> order(blocks);
  for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
  std::mt19937_64 order_rng(seed * 0x9E3779B97F4A7C15ull + launch_no);
  if (seed != 0) std::shuffle(order.begin(), order.end(), order_rng);

  Block b;
  b.body = &body;
  b.shuffle = seed != 0;
  b.warp_groups.resize(nwarps);
  b.smem_total_limit = opted_in ? kMaxSmemOptIn : kDefaultSmemLimit;
  b.rng.seed(seed ^ (launch_no << 20));
  w.block = &b;
  for (uint64_t bi : order) {
    const dim3 bidx(static_cast<unsigned>(bi % grid.x),
                    static_cast<unsigned>((bi / grid.x) % grid.y),
                    static_cast<unsigned>(bi / (uint64_t{grid.x} * grid.y)));
    b.fibers.clear();
    b.runnable.clear();
    for (auto& g : b.warp_groups) g.clear();
    b.live = nthreads;
    b.at_barrier = 0;
    b.barrier_generation = 0;
    for (auto& v : b.barrier_values) {
      v[0] = 0;
      v[1] = 1;
      v[2] = 0;
    }
    // Poisoned with all-ones: read as fp32 or bf16 that is NaN, so a kernel
    // that reads shared memory it never wrote gets NaN (as garbage can be on a
    // GPU) even where it multiplies by zero.
    if (dynamic_smem > 0) b.dynamic_smem.assign(dynamic_smem, 0xFF);
    b.static_smem.clear();
    b.static_smem_bytes = 0;
    for (int t = 0; t < nthreads; ++t) {
      Fiber* f = w.pool[t].get();
      ResetFiber(f);
      f->st.block_idx = bidx;
      f->st.block_dim = block;
      f->st.grid_dim = grid;
      f->st.thread_idx =
          dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      f->st.linear = t;
      f->st.lane = t % 32;
      f->st.warp = t / 32;
      b.fibers.push_back(f);
      b.runnable.push_back(f);
    }
    while (b.live > 0) {
      Fiber* f = PickRunnable(&b);
      if (f == nullptr) {
        if (b.fault.empty()) b.fault = DescribeDeadlock(b);
        break;
      }
      SwitchToFiber(f);
    }
    g_blocks.fetch_add(1);
    g_threads.fetch_add(threads);
    if (!b.fault.empty()) break;
  }
  g_switches.fetch_add(b.switches);
  w.block = nullptr;
  if (!b.fault.empty()) fail(b.fault);
}

}  // namespace cuda_sim

[[noreturn]] void __trap() {
  std::fprintf(stderr, "cuda_sim: __trap() in a kernel\n");
  std::abort();
}
