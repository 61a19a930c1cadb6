//! The streamer's invariants: whatever the buffer count and the order units are entered in,
//! the current unit's buffer holds exactly the source's bytes of each piece at its place, and
//! a unit's pieces are read in the order they are stored in the files.

use super::*;
use std::sync::Mutex;

/// Weights in memory, each stored (by `stored_at`) in the reverse of its id order; reads are
/// recorded.
struct Recording {
    weights: Vec<Vec<u8>>,
    reads: Mutex<Vec<WeightId>>,
}

impl WeightSource for Recording {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        Ok(self.weights[id.0 as usize].as_ptr())
    }

    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        self.reads.lock().unwrap().push(id);
        dst.copy_from_slice(&self.weights[id.0 as usize][offset..offset + dst.len()]);
        Ok(())
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        Some((0, 1000 - id.0 as u64))
    }
}

fn source() -> Arc<Recording> {
    let weights = (0..9u32)
        .map(|w| {
            (0..1000 + 37 * w as usize)
                .map(|i| (i as u32 * 7 + w * 31) as u8)
                .collect()
        })
        .collect();
    Arc::new(Recording {
        weights,
        reads: Mutex::new(Vec::new()),
    })
}

/// Three units of three weights each (the last unit reads a middle range of its weights).
fn units() -> Vec<Unit> {
    (0..3)
        .map(|u| {
            let mut unit = Unit::default();
            for w in 0..3u32 {
                let id = WeightId(u * 3 + w);
                let (from, len) = if u == 2 {
                    (100, 500)
                } else {
                    (0, 1000 + 37 * id.0 as usize)
                };
                unit.push(id, from, len);
            }
            unit
        })
        .collect()
}

#[test]
fn the_current_unit_holds_its_bytes_at_every_buffer_count() {
    for buffers in [1, 2] {
        let src = source();
        let units = units();
        let s = Streamer::new(units.clone(), 2, buffers, src.clone());
        for &u in &[0usize, 1, 2, 0, 2, 1, 1, 0] {
            s.enter(u);
            let base = s.bases()[u].load(Ordering::Relaxed) as *const u8;
            for p in &units[u].pieces {
                // SAFETY: `base` is the current unit's buffer, which holds `p.at + p.len` bytes
                // (the buffer is sized by the largest unit) and is not written while current.
                let got = unsafe { std::slice::from_raw_parts(base.add(p.at), p.len) };
                assert_eq!(
                    got,
                    &src.weights[p.weight.0 as usize][p.from..p.from + p.len],
                    "unit {u}"
                );
            }
        }
        assert!(s.take_error().is_none());
    }
}

#[test]
fn a_unit_is_read_in_file_order() {
    let src = source();
    let s = Streamer::new(units(), 3, 1, src.clone());
    s.enter(1);
    // Stored in reverse id order: weights 5, 4, 3.
    assert_eq!(*src.reads.lock().unwrap(), vec![WeightId(5), WeightId(4), WeightId(3)]);
}
