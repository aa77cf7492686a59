// The CPU kernels' own threads (blink.engine.kernels.cpu builds this file with the others): blink_cpu::parallel_for
// runs a parallel section as at::parallel_for does (the same chunks, the caller taking the first), on threads that
// wait for the next section by spinning (at most BLINK_CPU_SPIN_US microseconds, default 100; not at all where they
// are being preempted), then sleep on a futex.
//
// Why not torch's OpenMP threads: libgomp keeps a team of threads for every thread that ever started a parallel
// region, and once those outnumber the CPUs it cuts its wait to 100 spins, so that every section wakes its threads
// from sleep. The served engine is such a process on any machine: its main thread loaded the model (one team), the
// host loop's thread steps it (another). At batch 1 on 2 cores its second thread slept and was woken ~150 times a
// token (a section per projection and per layer's attention) and a token took twice the offline time. Unthrottled,
// libgomp spins 300,000 times (milliseconds) without yielding: a core held after the engine idles, and on cores
// shared with busy neighbours a section waits for a time slice (a token took 200 ms on a loaded 2-core VM). Here a
// wait is bounded in time: through the gaps between a forward's sections, not through the engine's idle time.
// BLINK_CPU_POOL=0 runs at::parallel_for instead (as does a section started while another runs, or from inside one).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using Body = std::function<void(int64_t, int64_t)>;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoll(v, nullptr, 10) : fallback;
}

const int64_t spin_ns = std::max<int64_t>(0, env_int("BLINK_CPU_SPIN_US", 100)) * 1000;
const bool enabled = env_int("BLINK_CPU_POOL", 1) != 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void futex(std::atomic<uint32_t>& word, int op, uint32_t value) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), op | FUTEX_PRIVATE_FLAG, value, nullptr, nullptr, 0);
}

// How long this thread spins before it sleeps: nothing where it was preempted since its last wait (its cores are
// shared with busy neighbours: there a spinning thread burns the core its partner waits for, and the scheduler
// favours threads that sleep; spinning 100 us made a served token 5x slower at a load of 10 on 2 cores), then
// doubling from 1 us wait after wait, up to spin_ns. Where the threads have the cores to themselves, they spin
// through a forward's gaps; elsewhere they sleep at once, as throttled libgomp's do.
thread_local int64_t budget_ns = 0;
thread_local long preempted = -1;  // this thread's involuntary context switches at its last wait

void plan_spin() {
  rusage usage;
  getrusage(RUSAGE_THREAD, &usage);
  budget_ns = usage.ru_nivcsw != preempted ? 0 : std::min(spin_ns, std::max<int64_t>(2 * budget_ns, 1000));
  preempted = usage.ru_nivcsw;
}

// Returns once `word` differs from `seen`: spinning up to budget_ns, then asleep. `sleepers` counts the threads
// asleep on the word, so that `bump` makes the wake-up call only for them (both sides sequentially consistent: the
// bump sees the sleeper, or the sleeper's futex call sees the new value and does not sleep).
void wait_change(std::atomic<uint32_t>& word, uint32_t seen, std::atomic<int>& sleepers) {
  if (word.load(std::memory_order_acquire) != seen) return;
  plan_spin();
  const int64_t until = now_ns() + budget_ns;
  for (int i = 1; word.load(std::memory_order_acquire) == seen; i++) {
    relax();
    if (i % 64 == 0 && now_ns() >= until) {
      sleepers.fetch_add(1);
      while (word.load() == seen) futex(word, FUTEX_WAIT, seen);
      sleepers.fetch_sub(1);
      return;
    }
  }
}

void bump(std::atomic<uint32_t>& word, std::atomic<int>& sleepers) {
  word.fetch_add(1);
  if (sleepers.load() > 0) futex(word, FUTEX_WAKE, INT_MAX);
}

// libgomp's own wait, made short: a thread that started one parallel region of two threads and then sleeps for good
// makes libgomp count more threads than CPUs wherever torch's threads fill the cores, so that its threads, after
// each of torch's own sections (a few a token at batch 1), spin 100 times and sleep instead of for milliseconds,
// while these threads would wait for a core. The served engine is in that state already (see above); this puts
// every process that runs these kernels in it. Costs two sleeping threads.
void quiet_openmp() {
  std::thread([] {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
#pragma omp parallel num_threads(2)
    { relax(); }
    for (;;) pause();
  }).detach();
}

thread_local bool in_section = false;  // a worker's, or a caller's while its section runs: nested sections run inline

struct Pool {
  std::mutex busy;  // one section at a time
  std::atomic<uint32_t> generation{0}, done{0};  // sections posted; workers' acknowledgements of them
  std::atomic<int> workers_asleep{0}, caller_asleep{0};
  int workers = 0;  // threads beside the caller, each acknowledging every section (with a chunk or without)
  // The section in flight, written before `generation` moves, read by the workers after.
  const Body* body = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  std::mutex error_lock;
  std::exception_ptr error;

  void work(int index, uint32_t seen) {
    in_section = true;
    sigset_t all;  // signals go to the interpreter's threads, never to these
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    for (;;) {
      wait_change(generation, seen, workers_asleep);
      seen++;  // the caller posts the next section only once every worker has acknowledged this one
      const int64_t lo = begin + index * chunk;
      if (lo < end) {
        try {
          (*body)(lo, std::min(end, lo + chunk));
        } catch (...) {
          std::lock_guard<std::mutex> hold(error_lock);
          if (!error) error = std::current_exception();
        }
      }
      bump(done, caller_asleep);
    }
  }

  void grow(int wanted) {  // under `busy`, no section in flight
    static std::once_flag quieted;
    std::call_once(quieted, quiet_openmp);
    for (; workers < wanted; workers++) {
      const uint32_t seen = generation.load();
      std::thread([this, index = workers + 1, seen] { work(index, seen); }).detach();
    }
  }

  void run(int64_t from, int64_t to, int64_t per_task, int tasks, const Body& f) {
    grow(tasks - 1);
    body = &f, begin = from, end = to, chunk = per_task;
    const uint32_t acknowledged = done.load() + workers;
    bump(generation, workers_asleep);
    in_section = true;
    std::exception_ptr mine;
    try {
      f(from, std::min(to, from + per_task));
    } catch (...) {
      mine = std::current_exception();
    }
    in_section = false;
    for (uint32_t d = done.load(std::memory_order_acquire); d != acknowledged; d = done.load(std::memory_order_acquire))
      wait_change(done, d, caller_asleep);
    std::exception_ptr theirs;
    std::swap(theirs, error);
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
  }
};

// Never destroyed: its threads are detached, asleep or spinning at exit. A forked child starts a new one (the parent's
// threads are not in it).
Pool* pool = new Pool();
const int forget_on_fork = pthread_atfork(nullptr, nullptr, [] { pool = new Pool(); });

}  // namespace

namespace blink_cpu {

// f over [begin, end) in chunks, as at::parallel_for(begin, end, grain, f) splits it over torch's thread count.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& f) {
  if (begin >= end) return;
  const int64_t range = end - begin, threads = at::get_num_threads();
  const int tasks = static_cast<int>(std::min(threads, (range + std::max<int64_t>(grain, 1) - 1) /
                                                          std::max<int64_t>(grain, 1)));
  if (tasks <= 1 || in_section || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  Pool* p = pool;
  std::unique_lock<std::mutex> hold(p->busy, std::try_to_lock);
  if (!enabled || !hold.owns_lock()) {  // another thread's section in flight: torch's threads take this one
    at::parallel_for(begin, end, grain, f);
    return;
  }
  p->run(begin, end, (range + tasks - 1) / tasks, tasks, f);
}

}  // namespace blink_cpu

namespace {

// For the tests: the chunk (its first index) that covered each index of [begin, end), -1 where more than one did;
// an index equal to fail_at raises in its chunk.
at::Tensor pool_chunks(int64_t begin, int64_t end, int64_t grain, int64_t fail_at) {
  auto out = at::full({std::max<int64_t>(0, end - begin)}, -2, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  blink_cpu::parallel_for(begin, end, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      TORCH_CHECK(i != fail_at, "blink_cpu::pool_chunks: index ", i, " fails, as asked");
      o[i - begin] = o[i - begin] == -2 ? lo : -1;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("pool_chunks(int begin, int end, int grain, int fail_at) -> Tensor", &pool_chunks);
}
