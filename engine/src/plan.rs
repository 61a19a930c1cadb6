//! Plans: a [`Graph`] with every kernel bound to its function and every argument to a pointer,
//! executed by the thread pool. Building a plan does all lookups once; running one does no
//! allocation, locking or system call.

use crate::buffers::AlignedBuf;
use crate::library::KernelLibrary;
use crate::pool::Pool;
use crate::stream::Streamer;
use kiln_core::Kernel;
use kiln_core::abi::{KernelFn, PTR_ARGS, WORK_COUNTER_ARG, WORK_COUNTER_BYTES, invoke};
use kiln_core::graph::{Arg, Graph};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// A pointer argument, resolved at plan build time except for its row offset.
#[derive(Clone, Copy)]
enum Slot {
    Null,
    Fixed(*mut u8),
    /// Row `rows - 1` of a buffer whose rows are `row_bytes` apart.
    LastRow {
        base: *mut u8,
        row_bytes: usize,
    },
    /// `offset` bytes into the stream buffer of a streamed unit (its address changes as units
    /// move through the buffers; `bases[unit]` holds it while the unit is current).
    Streamed {
        unit: usize,
        offset: usize,
    },
}

impl Slot {
    fn at(self, rows: usize, bases: &[AtomicUsize]) -> *mut u8 {
        match self {
            Slot::Null => std::ptr::null_mut(),
            Slot::Fixed(p) => p,
            // `wrapping_add` keeps this free of UB even for rows = 0, which `run` never passes.
            Slot::LastRow { base, row_bytes } => base.wrapping_add(rows.saturating_sub(1) * row_bytes),
            Slot::Streamed { unit, offset } => (bases[unit].load(Ordering::Relaxed) + offset) as *mut u8,
        }
    }
}

struct Node {
    f: KernelFn,
    args: [Slot; PTR_ARGS],
    barrier_before: bool,
    /// The streamed unit this node is the first (in this plan) to read: thread 0 makes it
    /// current between two barriers before the node runs.
    enter: Option<usize>,
    /// Kept for profiles (bytes moved and flops per call).
    kernel: Kernel,
}

/// Per-node wall time as seen by thread 0, and the bytes and flops each node accounted for,
/// accumulated over runs (`KILN_PROFILE=1`).
pub struct NodeTimes {
    nanos: Vec<AtomicU64>,
    bytes: Vec<AtomicU64>,
    flops: Vec<AtomicU64>,
    runs: AtomicU64,
    rows: AtomicU64,
    /// Per thread (up to [`MAX_PROFILED_THREADS`]): nanoseconds spent waiting at barriers.
    barrier_wait: Vec<AtomicU64>,
    /// Barriers passed per run (the same on every thread).
    barriers: AtomicU64,
}

/// Threads whose barrier waits a profile records.
pub const MAX_PROFILED_THREADS: usize = 64;

/// A snapshot of one node's accumulated profile.
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeProfile {
    pub nanos: u64,
    pub bytes: u64,
    pub flops: u64,
}

impl NodeTimes {
    fn new(n: usize) -> NodeTimes {
        let zeros = || (0..n).map(|_| AtomicU64::new(0)).collect();
        NodeTimes {
            nanos: zeros(),
            bytes: zeros(),
            flops: zeros(),
            runs: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            barrier_wait: (0..MAX_PROFILED_THREADS).map(|_| AtomicU64::new(0)).collect(),
            barriers: AtomicU64::new(0),
        }
    }
    /// Nanoseconds each of the first `threads` threads spent waiting at barriers, over all runs.
    pub fn barrier_wait(&self, threads: usize) -> Vec<u64> {
        self.barrier_wait
            .iter()
            .take(threads)
            .map(|a| a.load(Ordering::Relaxed))
            .collect()
    }
    /// Barriers passed per run.
    pub fn barriers_per_run(&self) -> u64 {
        self.barriers.load(Ordering::Relaxed)
    }
    pub fn nodes(&self) -> Vec<NodeProfile> {
        (0..self.nanos.len())
            .map(|i| NodeProfile {
                nanos: self.nanos[i].load(Ordering::Relaxed),
                bytes: self.bytes[i].load(Ordering::Relaxed),
                flops: self.flops[i].load(Ordering::Relaxed),
            })
            .collect()
    }
    /// Number of runs recorded.
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }
    /// Rows (tokens) processed over all runs.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }
}

/// An executable plan.
pub struct Plan {
    nodes: Vec<Node>,
    times: Option<NodeTimes>,
    /// One work counter per node (the ABI's `a7`), zeroed before every run.
    counters: AlignedBuf,
    /// Where streamed weights come from, when some of this plan's are.
    stream: Option<Arc<Streamer>>,
}

// SAFETY: the raw pointers in a plan point into buffers and weights owned by the engine that
// owns the plan; kernels only touch them through the pool while the engine is borrowed.
unsafe impl Send for Plan {}
// SAFETY: as for `Send`; `run` takes `&mut self`, so one plan runs once at a time.
unsafe impl Sync for Plan {}

/// Where a graph argument lives: a buffer (with the byte length of one of its rows) or a
/// weight (already offset to the first row the argument reads).
pub enum Resolved {
    Buffer {
        base: *mut u8,
        row_bytes: usize,
    },
    Weight(*const u8),
    /// A streamed weight: `offset` bytes into its unit's buffer.
    Streamed {
        unit: usize,
        offset: usize,
    },
}

impl Plan {
    /// Binds `graph` against `library`, resolving each argument with `resolve`; `stream`
    /// serves the arguments resolved as [`Resolved::Streamed`].
    pub fn build(
        graph: &Graph,
        library: &KernelLibrary,
        mut resolve: impl FnMut(&Kernel, &Arg) -> Result<Resolved, String>,
        profile: bool,
        stream: Option<Arc<Streamer>>,
    ) -> Result<Plan, String> {
        let mut last_unit = None;
        let mut nodes = Vec::with_capacity(graph.steps.len());
        let counters = AlignedBuf::zeroed(graph.steps.len().max(1) * WORK_COUNTER_BYTES);
        for (i, step) in graph.steps.iter().enumerate() {
            let f = library.get(&step.kernel).ok_or_else(|| {
                format!(
                    "library {} lacks kernel {}",
                    library.path().display(),
                    step.kernel.symbol()
                )
            })?;
            let mut args = [Slot::Null; PTR_ARGS];
            let mut unit = None;
            for (slot, arg) in args.iter_mut().zip(&step.args) {
                *slot = match (arg, resolve(&step.kernel, arg)?) {
                    (Arg::LastRow(_), Resolved::Buffer { base, row_bytes }) => Slot::LastRow { base, row_bytes },
                    (_, Resolved::Buffer { base, .. }) => Slot::Fixed(base),
                    (_, Resolved::Weight(p)) => Slot::Fixed(p as *mut u8),
                    (_, Resolved::Streamed { unit: u, offset }) => {
                        if unit.is_some_and(|v| v != u) {
                            return Err(format!("{} reads two streamed units", step.kernel.symbol()));
                        }
                        unit = Some(u);
                        Slot::Streamed { unit: u, offset }
                    }
                };
            }
            if unit.is_some() && stream.is_none() {
                return Err(format!(
                    "{} reads a streamed weight but no streamer serves it",
                    step.kernel.symbol()
                ));
            }
            let enter = unit.filter(|&u| last_unit != Some(u));
            last_unit = unit.or(last_unit);
            if step.args.len() > WORK_COUNTER_ARG {
                return Err(format!(
                    "{} takes more buffers than the ABI has slots",
                    step.kernel.symbol()
                ));
            }
            // `wrapping_add` keeps the arithmetic defined; the offset is inside `counters`.
            args[WORK_COUNTER_ARG] = Slot::Fixed(counters.as_ptr().wrapping_add(i * WORK_COUNTER_BYTES));
            nodes.push(Node {
                f,
                args,
                barrier_before: step.barrier_before,
                enter,
                kernel: step.kernel.clone(),
            });
        }
        let times = profile.then(|| NodeTimes::new(nodes.len()));
        Ok(Plan {
            nodes,
            times,
            counters,
            stream,
        })
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    pub fn times(&self) -> Option<&NodeTimes> {
        self.times.as_ref()
    }

    /// Runs every node on every pool thread for a block of `rows` rows (whose positions and
    /// slots the engine wrote into `row_info`; `pos`, the first row's position, only feeds the
    /// profile's byte and FLOP estimates). [`Arg::LastRow`] arguments point at row `src_rows - 1` of their buffer: the output head
    /// runs one row (`rows = 1`) taken from the end of a block of `src_rows` rows.
    ///
    /// Takes `&mut self` because it resets the plan's work counters: one plan runs once at a time.
    pub fn run(&mut self, pool: &Pool, rows: usize, pos: usize, src_rows: usize) {
        assert!(rows >= 1 && src_rows >= 1, "a plan runs on at least one row");
        // SAFETY: `counters` is this plan's own allocation of exactly this many bytes, and no
        // kernel is running (the previous run returned; `&mut self` excludes a concurrent one).
        unsafe { std::ptr::write_bytes(self.counters.as_ptr(), 0, self.nodes.len().max(1) * WORK_COUNTER_BYTES) };
        let this = &*self;
        let nth = pool.threads() as i64;
        let rows_i = rows as i64;
        let no_bases: [AtomicUsize; 0] = [];
        let bases = this.stream.as_ref().map_or(&no_bases[..], |s| s.bases());
        pool.run(&|tid, barrier| {
            let timed = tid == 0 && this.times.is_some();
            let mut last = if timed { Some(Instant::now()) } else { None };
            let mut waited = 0u64;
            let mut barriers = 0u64;
            let mut wait = || {
                if this.times.is_some() {
                    let t = Instant::now();
                    barrier.wait();
                    waited += t.elapsed().as_nanos() as u64;
                    barriers += 1;
                } else {
                    barrier.wait();
                }
            };
            for (i, node) in this.nodes.iter().enumerate() {
                if let (Some(unit), Some(stream)) = (node.enter, &this.stream) {
                    // Every thread is done with the previous unit before its buffer is
                    // reused, and the new one is in place before anyone reads it.
                    wait();
                    if tid == 0 {
                        stream.enter(unit);
                    }
                    wait();
                } else if node.barrier_before {
                    wait();
                }
                if let Some(t) = last.as_mut() {
                    // Time since the previous node started: its own work plus the wait for
                    // the slowest thread at the barrier that follows it.
                    let now = Instant::now();
                    if i > 0 {
                        this.add_time(i - 1, now - *t);
                    }
                    *t = now;
                }
                let a = node.args.map(|s| s.at(src_rows, bases));
                // SAFETY: `f` has the ABI signature; the pointers were resolved for buffers and
                // weights sized for this plan's kernels, and `rows` and the rows' positions and
                // slots were checked by the engine against those sizes.
                unsafe { invoke(node.f, a, rows_i, tid as i64, nth) };
            }
            if let Some(times) = &this.times {
                // Every thread meets here so the last node's time includes its slowest thread.
                let t = Instant::now();
                barrier.wait();
                waited += t.elapsed().as_nanos() as u64;
                if let Some(slot) = times.barrier_wait.get(tid) {
                    slot.fetch_add(waited, Ordering::Relaxed);
                }
                if tid == 0 {
                    times.barriers.store(barriers + 1, Ordering::Relaxed);
                }
                if let Some(t) = last {
                    this.add_time(this.nodes.len() - 1, t.elapsed());
                    times.runs.fetch_add(1, Ordering::Relaxed);
                    times.rows.fetch_add(rows as u64, Ordering::Relaxed);
                    for (i, node) in this.nodes.iter().enumerate() {
                        times.bytes[i].fetch_add(node.kernel.bytes_moved(rows, pos), Ordering::Relaxed);
                        times.flops[i].fetch_add(node.kernel.flops(rows, pos), Ordering::Relaxed);
                    }
                }
            }
        });
    }

    fn add_time(&self, node: usize, d: std::time::Duration) {
        if let Some(times) = &self.times {
            times.nanos[node].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
    }
}
