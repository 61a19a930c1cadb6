//! Weights streamed from disk under `--ram-budget` (see `kiln_core::budget`).
//!
//! A [`Streamer`] owns one or two stream buffers and an I/O thread. The weights of a streamed
//! unit (a decoder layer, or a chunk of rows of the output head) are read into a buffer with
//! the source's [`WeightSource::read_range`] (`pread`, then dropped from the page cache), so
//! they hold memory only while their buffer does. Plans reach a unit's weights through
//! [`Streamer::bases`], the address of the unit's data while it is the current one; before the
//! first kernel of a unit runs, the plan's thread 0 calls [`Streamer::enter`], which waits for
//! the unit to be in a buffer and then asks the I/O thread for the unit predicted to come next,
//! into the other buffer: reading overlaps computing.
//!
//! A token table that is not kept is read a row per token ([`Gather`]) into an address range
//! the size of the table whose pages exist only while a call uses them.

use crate::buffers::AlignedBuf;
use crate::engine::WeightSource;
use kiln_core::WeightId;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Bytes of one weight (or of rows of one) that a unit reads into its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub weight: WeightId,
    /// Byte offset within the weight's bytes.
    pub from: usize,
    pub len: usize,
    /// Byte offset within the stream buffer (64-byte aligned).
    pub at: usize,
}

/// One streamed unit: the pieces read together into one buffer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unit {
    pub pieces: Vec<Piece>,
}

impl Unit {
    /// Bytes of buffer the unit needs.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.at + p.len).max().unwrap_or(0)
    }
    /// Appends `len` bytes of `weight` from `from`, 64-byte aligned after the previous piece.
    pub fn push(&mut self, weight: WeightId, from: usize, len: usize) -> Piece {
        let at = self.bytes().next_multiple_of(64);
        let piece = Piece { weight, from, len, at };
        self.pieces.push(piece);
        piece
    }
}

/// What the compute side and the I/O thread share.
struct Shared {
    units: Vec<Unit>,
    bufs: Vec<AlignedBuf>,
    /// Per unit: the address of its buffer while it is current.
    bases: Vec<AtomicUsize>,
    source: Arc<dyn WeightSource>,
    state: Mutex<State>,
    changed: Condvar,
    bytes_read: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Per buffer: the unit it holds or is being filled with.
    holds: Vec<Option<usize>>,
    /// Per buffer: filled.
    ready: Vec<bool>,
    /// The buffer compute reads.
    current: Option<usize>,
    /// Buffer the I/O thread is filling.
    busy: Option<usize>,
    /// Loads not started: (unit, buffer).
    queue: VecDeque<(usize, usize)>,
    error: Option<String>,
    quit: bool,
}

/// Streams units through a small pool of buffers; see the module documentation.
pub struct Streamer {
    shared: Arc<Shared>,
    /// Order in which units are used by a forward pass: the layer units, then the head's.
    layer_units: usize,
    /// Whether the output head runs after the layers of the pass in progress (the engine says
    /// so before each block), so the head's first chunk is read after the last layer.
    head_follows: AtomicBool,
    io: Option<JoinHandle<()>>,
}

impl Streamer {
    /// A streamer of `units` (the first `layer_units` of them the layers, in order, the rest the
    /// head's chunks) through `buffers` buffers of the largest unit's size, reading from `source`.
    pub fn new(mut units: Vec<Unit>, layer_units: usize, buffers: usize, source: Arc<dyn WeightSource>) -> Streamer {
        // Each unit is read in file order (see `WeightSource::stored_at`); where each piece
        // lands in the buffer does not change.
        for u in &mut units {
            u.pieces.sort_by_key(|p| (source.stored_at(p.weight), p.from));
        }
        let size = units.iter().map(Unit::bytes).max().unwrap_or(0).max(64);
        let n = buffers.max(1);
        let shared = Arc::new(Shared {
            bases: (0..units.len()).map(|_| AtomicUsize::new(0)).collect(),
            bufs: (0..n).map(|_| AlignedBuf::zeroed(size)).collect(),
            units,
            source,
            state: Mutex::new(State {
                holds: vec![None; n],
                ready: vec![false; n],
                ..State::default()
            }),
            changed: Condvar::new(),
            bytes_read: AtomicU64::new(0),
        });
        let io_shared = shared.clone();
        let io = std::thread::Builder::new()
            .name("kiln-stream".into())
            .spawn(move || io_loop(&io_shared))
            .expect("spawning the stream I/O thread");
        Streamer {
            shared,
            layer_units,
            head_follows: AtomicBool::new(false),
            io: Some(io),
        }
    }

    /// Per unit, the address of its data while it is current (read by plans after a barrier
    /// that follows [`Streamer::enter`]).
    pub fn bases(&self) -> &[AtomicUsize] {
        &self.shared.bases
    }

    pub fn units(&self) -> usize {
        self.shared.units.len()
    }

    /// Bytes read from disk so far.
    pub fn bytes_read(&self) -> u64 {
        self.shared.bytes_read.load(Ordering::Relaxed)
    }

    /// Tells the streamer whether the head follows the layers of the pass about to run.
    pub fn set_head_follows(&self, yes: bool) {
        self.head_follows.store(yes, Ordering::Relaxed);
    }

    /// The first read error since the last call, if any (the pass that met it computed on
    /// stale weights and must be discarded).
    pub fn take_error(&self) -> Option<String> {
        self.lock().error.take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The unit expected after `unit` in a forward pass.
    fn next(&self, unit: usize) -> usize {
        let n = self.shared.units.len();
        let heads = n - self.layer_units;
        let last_layer = unit + 1 == self.layer_units;
        if unit + 1 < n && !last_layer {
            unit + 1
        } else if last_layer && heads > 0 && (self.head_follows.load(Ordering::Relaxed) || self.layer_units == 0) {
            self.layer_units
        } else if self.layer_units > 0 {
            0
        } else {
            self.layer_units
        }
    }

    /// Makes `unit` the current one: waits until it is in a buffer (reading it now if no read
    /// was started), publishes its address, and starts reading the next unit into another
    /// buffer. Called by one thread while every compute thread waits at a barrier, so the
    /// previous unit's buffer is no longer read.
    pub fn enter(&self, unit: usize) {
        let mut st = self.lock();
        let buf = match st.holds.iter().position(|&h| h == Some(unit)) {
            Some(b) => b,
            None => {
                let b = self.free_buffer(&st, None);
                st = self.assign(st, b, unit);
                b
            }
        };
        while !st.ready[buf] && st.error.is_none() {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.current = Some(buf);
        let base = self.shared.bufs[buf].as_ptr() as usize;
        self.shared.bases[unit].store(base, Ordering::Relaxed);
        let next = self.next(unit);
        if next != unit && !st.holds.contains(&Some(next)) && self.shared.bufs.len() > 1 {
            let b = self.free_buffer(&st, Some(buf));
            if st.busy != Some(b) {
                drop(self.assign(st, b, next));
            }
        }
    }

    /// A buffer to load into: not `keep`, preferring one that is not being filled.
    fn free_buffer(&self, st: &State, keep: Option<usize>) -> usize {
        let n = self.shared.bufs.len();
        (0..n)
            .filter(|&b| Some(b) != keep)
            .min_by_key(|&b| (st.busy == Some(b)) as u8)
            .unwrap_or(0)
    }

    /// Queues a load of `unit` into buffer `b` (waiting for a load in progress there first).
    fn assign<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State>,
        b: usize,
        unit: usize,
    ) -> std::sync::MutexGuard<'a, State> {
        st.queue.retain(|&(_, qb)| qb != b);
        while st.busy == Some(b) {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.holds[b] = Some(unit);
        st.ready[b] = false;
        st.queue.push_back((unit, b));
        self.shared.changed.notify_all();
        st
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        self.lock().quit = true;
        self.shared.changed.notify_all();
        if let Some(io) = self.io.take() {
            let _ = io.join();
        }
    }
}

/// The I/O thread: fills buffers in the order loads were queued.
fn io_loop(shared: &Shared) {
    let lock = || shared.state.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let (unit, b) = {
            let mut st = lock();
            loop {
                if st.quit {
                    return;
                }
                if let Some(job) = st.queue.pop_front() {
                    st.busy = Some(job.1);
                    break job;
                }
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let result = read_unit(shared, unit, b);
        let mut st = lock();
        st.busy = None;
        match result {
            Ok(bytes) => {
                shared.bytes_read.fetch_add(bytes, Ordering::Relaxed);
                st.ready[b] = st.holds[b] == Some(unit);
            }
            Err(e) => {
                st.holds[b] = None;
                st.error.get_or_insert(e);
            }
        }
        shared.changed.notify_all();
    }
}

/// Reads every piece of `unit` into buffer `b`; returns the bytes read.
fn read_unit(shared: &Shared, unit: usize, b: usize) -> Result<u64, String> {
    let buf = &shared.bufs[b];
    let mut total = 0;
    for p in &shared.units[unit].pieces {
        assert!(p.at + p.len <= buf.bytes(), "a piece lies inside its buffer");
        // SAFETY: the range is inside buffer `b` (asserted), which no compute thread reads
        // while it is being filled (it is not current: `enter` waits for `ready`), and only
        // this thread writes it.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr().add(p.at), p.len) };
        shared.source.read_range(p.weight, p.from, dst)?;
        total += p.len as u64;
    }
    Ok(total)
}

/// A token table read a row per token: an address range the table's size, of which only the
/// rows of the tokens of one call hold memory, and only during that call.
pub struct Gather {
    region: AlignedBuf,
    table: WeightId,
    row_bytes: usize,
    /// Byte ranges loaded for the call in progress.
    loaded: Vec<(usize, usize)>,
    bytes_read: u64,
}

impl Gather {
    pub fn new(table: WeightId, rows: usize, row_bytes: usize) -> Gather {
        Gather {
            // At least 1 MiB, so the region is always its own anonymous mapping (see
            // `AlignedBuf::reserved`), whose pages `release` may drop.
            region: AlignedBuf::reserved((rows * row_bytes).max(1 << 20)),
            table,
            row_bytes,
            loaded: Vec::new(),
            bytes_read: 0,
        }
    }

    /// The table's address as the embedding kernel reads it.
    pub fn table_ptr(&self) -> *const u8 {
        self.region.as_ptr()
    }

    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Reads the rows of `tokens` (ids checked against the vocabulary by the engine).
    pub fn load(&mut self, source: &dyn WeightSource, tokens: &[u32]) -> Result<(), String> {
        for &t in tokens {
            let from = t as usize * self.row_bytes;
            if self.loaded.iter().any(|&(f, _)| f == from) {
                continue;
            }
            assert!(from + self.row_bytes <= self.region.bytes(), "a row inside the table");
            // SAFETY: the row lies inside the region (asserted); no kernel runs while the
            // engine loads rows (it holds `&mut self`).
            let dst = unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(from), self.row_bytes) };
            source.read_range(self.table, from, dst)?;
            self.loaded.push((from, self.row_bytes));
            self.bytes_read += self.row_bytes as u64;
        }
        Ok(())
    }

    /// Gives the pages of the rows loaded back to the system.
    pub fn release(&mut self) {
        const PAGE: usize = 4096;
        let base = self.region.as_ptr() as usize;
        if !self.region.is_mapped() {
            // A heap fallback (the mapping failed): its pages may be shared, so keep them.
            self.loaded.clear();
            return;
        }
        for (from, len) in self.loaded.drain(..) {
            let start = (base + from) / PAGE * PAGE;
            let end = (base + from + len).next_multiple_of(PAGE);
            // SAFETY: the pages lie within the region, a private anonymous mapping of its own
            // (page-aligned, at least 1 MiB): dropping them only zeroes rows that are loaded
            // again before they are read; no kernel runs now.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
