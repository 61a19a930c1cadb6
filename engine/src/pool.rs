//! A persistent pool of compute threads, one per physical core; the calling thread is thread 0
//! (left unpinned, on the core the workers leave free) and each worker is pinned to a core.
//!
//! A job is a closure every thread runs with its thread id; inside it, threads meet at a barrier
//! between dependent kernels. When every thread has a CPU of its own, a waiting thread spins
//! (yielding now and then): the others are microseconds away, and waking a sleeping thread costs
//! tens of microseconds. With more threads than CPUs a spinning thread holds the core the awaited
//! thread needs (4 threads on 2 cores decoded at a quarter of the speed of 2), so there it spins
//! for a few microseconds only, then sleeps in the kernel until the last thread arrives.
//! Between jobs the workers spin for a short while (decode posts a job every few milliseconds),
//! then park so an idle engine does not hold the other cores.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking, when every thread has a CPU.
/// Stack of each compute thread (see `Pool::new`); the thread that calls `run` needs as much
/// (`kiln serve`'s engine thread is made with it).
pub const WORKER_STACK_BYTES: usize = 16 << 20;

const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);
/// With more threads than CPUs: how long a thread waiting at a barrier (or for the workers to
/// finish, or idle between jobs) spins before it sleeps. A spinning thread then delays the one
/// it waits for, so it gives up its core almost at once.
const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(5);
/// Spin iterations between checks of the clock (and, times 64, between yields).
const SPINS_PER_CHECK: u32 = 256;

/// How long waiting threads of a pool spin before they sleep.
#[derive(Clone, Copy, Debug)]
struct Spin {
    /// At barriers and for the workers to finish; `None`: spin (and yield) until released.
    barrier: Option<Duration>,
    /// Between jobs.
    idle: Duration,
}

impl Spin {
    fn for_threads(n: usize, cpus: usize) -> Spin {
        if n > cpus {
            Spin {
                barrier: Some(OVERSUBSCRIBED_SPIN),
                idle: OVERSUBSCRIBED_SPIN,
            }
        } else {
            // Sleeping after a long wait was measured slower (decode 10 % under a machine
            // load of 5-10) than spinning on: a thread that only yields is back at once.
            Spin {
                barrier: None,
                idle: SPIN_BEFORE_PARK,
            }
        }
    }
}

/// A 32-bit counter threads can wait on until it changes: spinning for a while, then sleeping
/// in the kernel (a futex on Linux) until [`Counter::add`] wakes them.
struct Counter {
    value: AtomicU32,
    /// Threads in (or about to enter) the kernel wait; `add` makes the wake-up call only then,
    /// so the common case costs one extra load.
    sleepers: AtomicU32,
}

impl Counter {
    fn new() -> Counter {
        Counter {
            value: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    fn load(&self) -> u32 {
        self.value.load(Ordering::Acquire)
    }

    /// Adds one and wakes every sleeper; returns the previous value.
    fn add(&self) -> u32 {
        // SeqCst on both sides (here: the add, then the load of `sleepers`; in `wait_while`: the
        // increment of `sleepers`, then the kernel's or our load of the value): either the
        // waiter sees the new value, or this sees the waiter and wakes it.
        let previous = self.value.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            futex::wake_all(&self.value);
        }
        previous
    }

    fn store(&self, value: u32) {
        self.value.store(value, Ordering::Relaxed);
    }

    /// Returns once the value is no longer `current`: spins (yielding now and then, so a peer
    /// waiting for this core can run), and with a `spin` limit sleeps once it has passed.
    fn wait_while(&self, current: u32, spin: Option<Duration>) {
        // The clock is read from the first check on: most waits end before it.
        let mut started = None;
        let mut spins = 0u32;
        while self.value.load(Ordering::Acquire) == current {
            std::hint::spin_loop();
            spins += 1;
            if !spins.is_multiple_of(SPINS_PER_CHECK) {
                continue;
            }
            if let Some(limit) = spin
                && started.get_or_insert_with(Instant::now).elapsed() > limit
            {
                self.sleep_while(current);
                return;
            }
            if spins.is_multiple_of(SPINS_PER_CHECK * 64) {
                std::thread::yield_now();
            }
        }
    }

    fn sleep_while(&self, current: u32) {
        loop {
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if self.value.load(Ordering::SeqCst) == current {
                // Returns when woken, at once if the value already changed, or on a signal.
                futex::wait(&self.value, current);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if self.value.load(Ordering::Acquire) != current {
                return;
            }
        }
    }
}

/// The kernel's wait-on-address: a thread sleeps until another changes the word and wakes it.
#[cfg(target_os = "linux")]
mod futex {
    use std::sync::atomic::AtomicU32;

    /// Sleeps while `word` holds `expected` (the kernel checks that atomically with queueing
    /// the thread), until woken; spurious returns are possible.
    pub fn wait(word: &AtomicU32, expected: u32) {
        // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word`, which lives for the call; a
        // null timeout means no timeout. The result (woken, EAGAIN, EINTR) is rechecked by the
        // caller.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                std::ptr::null::<libc::timespec>(),
            );
        }
    }

    /// Wakes every thread sleeping on `word`.
    pub fn wake_all(word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE only uses the address of `word` as a key; no memory is accessed.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                i32::MAX,
            );
        }
    }
}

/// Without futexes a "sleeping" thread yields its core and checks again.
#[cfg(not(target_os = "linux"))]
mod futex {
    use std::sync::atomic::{AtomicU32, Ordering};

    pub fn wait(word: &AtomicU32, expected: u32) {
        if word.load(Ordering::Acquire) == expected {
            std::thread::yield_now();
        }
    }

    pub fn wake_all(_word: &AtomicU32) {}
}

/// A reusable barrier for a fixed number of threads.
pub struct Barrier {
    n: usize,
    arrived: AtomicUsize,
    /// Incremented by the last thread to arrive, which releases the others.
    generation: Counter,
    spin: Option<Duration>,
}

impl Barrier {
    fn new(n: usize, spin: Option<Duration>) -> Barrier {
        Barrier {
            n,
            arrived: AtomicUsize::new(0),
            generation: Counter::new(),
            spin,
        }
    }

    /// Blocks until all `n` threads have called `wait`: spins, and with more threads than CPUs
    /// sleeps after a few microseconds (see the module documentation).
    pub fn wait(&self) {
        if self.n == 1 {
            return;
        }
        let generation = self.generation.load();
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.add();
            return;
        }
        self.generation.wait_while(generation, self.spin);
    }
}

/// The job every thread runs: `(thread_id, barrier)`.
type Job<'a> = dyn Fn(usize, &Barrier) + Sync + 'a;

struct Shared {
    n: usize,
    barrier: Barrier,
    /// Incremented to publish a job; workers run each epoch once.
    epoch: AtomicU64,
    /// Workers that finished the current epoch.
    finished: Counter,
    spin: Spin,
    /// Type-erased pointer to the current job (valid while the epoch runs).
    job: Mutex<Option<JobPtr>>,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job<'static>);
// SAFETY: the pointed-to closure is `Sync`, and `Pool::run` keeps it alive until every worker
// has finished with it.
unsafe impl Send for JobPtr {}

/// The thread pool.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `n` threads in all (the caller plus `n - 1` workers). With `cores`, worker `i` is
    /// pinned to `cores[i]` and `cores[0]` is left to the caller, which is not pinned itself:
    /// pinning it would tie the embedding program's thread (and every process it spawns) to one
    /// core, and the scheduler keeps it on the core the workers leave free.
    ///
    /// With more threads than this process has CPUs, waiting threads give up their core after a
    /// few microseconds instead of spinning (see the module documentation).
    pub fn new(n: usize, cores: Option<&[usize]>) -> Pool {
        let n = n.max(1);
        let spin = Spin::for_threads(n, available_cpus());
        let shared = Arc::new(Shared {
            n,
            barrier: Barrier::new(n, spin.barrier),
            epoch: AtomicU64::new(0),
            finished: Counter::new(),
            spin,
            job: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        });
        let workers: Vec<JoinHandle<()>> = (1..n)
            .map(|tid| {
                let shared = shared.clone();
                let core = cores.and_then(|c| c.get(tid).copied());
                std::thread::Builder::new()
                    .name(format!("kiln-worker-{tid}"))
                    // Kernels keep per-thread buffers on the stack (`--precision q8` prefill:
                    // the block's rows as bytes, up to 1 MiB, larger ones on the heap;
                    // `--precision bf16`: up to 4 MiB); untouched pages cost nothing.
                    .stack_size(WORKER_STACK_BYTES)
                    .spawn(move || {
                        if let Some(core) = core {
                            pin_current_thread(core);
                        }
                        worker_loop(&shared, tid)
                    })
                    .expect("spawn a compute thread")
            })
            .collect();
        Pool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.shared.n
    }

    /// Runs `job` on every thread (the caller as thread 0) and returns when all are done.
    pub fn run(&self, job: &Job<'_>) {
        let s = &*self.shared;
        if s.n == 1 {
            job(0, &s.barrier);
            return;
        }
        // SAFETY: the lifetime is erased only for the duration of this call: we do not return
        // before every worker has reported `finished`, after which none touches the pointer.
        let ptr = JobPtr(unsafe { std::mem::transmute::<*const Job<'_>, *const Job<'static>>(job as *const Job<'_>) });
        *s.job.lock().expect("pool job lock") = Some(ptr);
        s.finished.store(0);
        s.epoch.fetch_add(1, Ordering::Release);
        if s.sleepers.load(Ordering::Acquire) > 0 {
            let _guard = s.sleep_lock.lock().expect("pool sleep lock");
            s.wake.notify_all();
        }
        job(0, &s.barrier);
        loop {
            let finished = s.finished.load();
            if finished as usize >= s.n - 1 {
                break;
            }
            s.finished.wait_while(finished, s.spin.barrier);
        }
        *s.job.lock().expect("pool job lock") = None;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _guard = self.shared.sleep_lock.lock().expect("pool sleep lock");
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker_loop(s: &Shared, tid: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin first, then park.
        let spin_start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if s.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(SPINS_PER_CHECK) && spin_start.elapsed() > s.spin.idle {
                let guard = s.sleep_lock.lock().expect("pool sleep lock");
                s.sleepers.fetch_add(1, Ordering::AcqRel);
                // Re-check under the lock: `run` notifies while holding it.
                let _guard = s
                    .wake
                    .wait_while(guard, |_| {
                        s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire)
                    })
                    .expect("pool sleep lock");
                s.sleepers.fetch_sub(1, Ordering::AcqRel);
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        let job = s
            .job
            .lock()
            .expect("pool job lock")
            .expect("a job is published with its epoch");
        // SAFETY: `run` keeps the job alive until this thread increments `finished`.
        unsafe { (*job.0)(tid, &s.barrier) };
        s.finished.add();
    }
}

/// Pins the calling thread to one logical CPU; failures are ignored (pinning is an
/// optimisation, and may be forbidden in containers).
fn pin_current_thread(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `set` is a properly initialised cpu_set_t on the stack; pid 0 is this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}

/// One logical CPU per physical core this process may run on, in order: the default thread
/// count and pinning targets. Falls back to all allowed CPUs when topology is unknown.
pub fn physical_cores() -> Vec<usize> {
    let allowed = allowed_cpus();
    let mut seen = std::collections::HashSet::new();
    let mut cores = Vec::new();
    for &cpu in &allowed {
        let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |f: &str| {
            std::fs::read_to_string(format!("{topo}/{f}"))
                .ok()
                .map(|s| s.trim().to_string())
        };
        match (read("physical_package_id"), read("core_id")) {
            (Some(pkg), Some(core)) => {
                if seen.insert((pkg, core)) {
                    cores.push(cpu);
                }
            }
            _ => cores.push(cpu),
        }
    }
    if cores.is_empty() {
        let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        cores = (0..n).collect();
    }
    cores
}

/// How many CPUs this process may run on (its affinity mask): more compute threads than this
/// wait on each other.
pub fn available_cpus() -> usize {
    allowed_cpus().len().max(1)
}

/// The CPUs this process may use, read once: later reads on a pinned thread would see only
/// its own core.
fn allowed_cpus() -> Vec<usize> {
    static ALLOWED: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    ALLOWED.get_or_init(read_allowed_cpus).clone()
}

fn read_allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    // SAFETY: `set` is zero-initialised and sized for the call; pid 0 is this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            return (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
        }
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (0..n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_job_and_barriers_order_phases() {
        let pool = Pool::new(3, None);
        for round in 0..200 {
            let hits = AtomicUsize::new(0);
            let phase2 = AtomicUsize::new(0);
            pool.run(&|_tid, barrier| {
                hits.fetch_add(1, Ordering::Relaxed);
                barrier.wait();
                // After the barrier every thread must see all three phase-1 increments.
                assert_eq!(hits.load(Ordering::Relaxed), 3, "round {round}");
                phase2.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(phase2.load(Ordering::Relaxed), 3);
        }
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = Pool::new(2, None);
        std::thread::sleep(SPIN_BEFORE_PARK * 3);
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    /// Seconds `threads` threads take for `jobs` jobs of `phases` phases, each phase `work`
    /// steps split evenly between the threads and ended by a barrier (decode's shape).
    fn timed(threads: usize, jobs: usize, phases: usize, work: u64) -> f64 {
        let pool = Pool::new(threads, None);
        let t0 = Instant::now();
        for _ in 0..jobs {
            pool.run(&|_, barrier| {
                for _ in 0..phases {
                    let mut x = 0u64;
                    for i in 0..work / threads as u64 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                    }
                    barrier.wait();
                }
            });
        }
        t0.elapsed().as_secs_f64()
    }

    #[test]
    fn twice_as_many_threads_as_cpus_do_not_collapse() {
        // With more threads than CPUs, waiting threads must give their core to the ones they
        // wait for: spinning waiters made 4 threads on 2 cores decode at a quarter of the
        // speed of 2 threads. The same work on twice the threads must take about as long.
        let cpus = available_cpus();
        // About 100 µs of work per thread and phase with one thread per CPU.
        let (jobs, phases, work) = (40, 50, 100_000 * cpus as u64);
        let mut ratios = Vec::new();
        for _ in 0..3 {
            let fit = timed(cpus, jobs, phases, work);
            let over = timed(2 * cpus, jobs, phases, work);
            ratios.push(over / fit);
        }
        ratios.sort_by(f64::total_cmp);
        assert!(
            ratios[1] < 2.0,
            "{} threads on {cpus} CPUs took {:.1}x the time of {cpus} threads (ratios {ratios:.2?})",
            2 * cpus,
            ratios[1]
        );
    }

    #[test]
    fn physical_cores_is_never_empty() {
        assert!(!physical_cores().is_empty());
    }
}
