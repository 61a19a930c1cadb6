//! A persistent pool of compute threads, one per physical core, pinned; the calling thread is
//! thread 0.
//!
//! A job is a closure every thread runs with its thread id; inside it, threads meet at a spin
//! barrier between dependent kernels. Between jobs the workers spin for a short while (decode
//! posts a job every few milliseconds, and waking a parked thread costs tens of microseconds),
//! then park so an idle engine does not hold the other cores.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking.
const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);
/// Spin iterations between checks of the clock / yields while waiting at a barrier.
const SPINS_PER_CHECK: u32 = 256;

/// A reusable sense-counting barrier for a fixed number of threads.
pub struct Barrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl Barrier {
    fn new(n: usize) -> Barrier {
        Barrier {
            n,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        }
    }

    /// Blocks until all `n` threads have called `wait`. Spins, yielding now and then so an
    /// oversubscribed machine still makes progress.
    pub fn wait(&self) {
        if self.n == 1 {
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(SPINS_PER_CHECK * 64) {
                std::thread::yield_now();
            }
        }
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
    finished: AtomicUsize,
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
    pub fn new(n: usize, cores: Option<&[usize]>) -> Pool {
        let n = n.max(1);
        let shared = Arc::new(Shared {
            n,
            barrier: Barrier::new(n),
            epoch: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
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
        s.finished.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        if s.sleepers.load(Ordering::Acquire) > 0 {
            let _guard = s.sleep_lock.lock().expect("pool sleep lock");
            s.wake.notify_all();
        }
        job(0, &s.barrier);
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) < s.n - 1 {
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(SPINS_PER_CHECK * 64) {
                std::thread::yield_now();
            }
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
            if spins.is_multiple_of(SPINS_PER_CHECK) && spin_start.elapsed() > SPIN_BEFORE_PARK {
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
        s.finished.fetch_add(1, Ordering::Release);
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

    #[test]
    fn physical_cores_is_never_empty() {
        assert!(!physical_cores().is_empty());
    }
}
