//! Saved recurrent states, so a sequence of a recurrent model can be cut back to a position it
//! passed through instead of only restarted.
//!
//! A recurrent layer's state (`Rows::State`) holds every token so far: unlike a KV cache, it
//! cannot be cut back to a shorter prefix. A chat turn whose rendered history differs from
//! what the engine holds only after the last prompt (a template that drops the reasoning of
//! earlier replies does exactly that) would then re-run the whole conversation. Instead the
//! caller saves each slot's state where a prompt ends ([`Checkpoints::save`]), and a cut at or
//! after that position restores it ([`Checkpoints::restore`]), so only the tokens after it run
//! again. A checkpoint is dropped as soon as the sequence is cut before it or restarted: the
//! tokens it summarises are then no longer the sequence's, and it must never be restored.

use crate::buffers::Buffers;
use kiln_core::spec::{BufId, ModelSpec, Rows};

/// One slot's recurrent state as it was after `position` tokens.
struct Saved {
    position: usize,
    /// A copy of the slot's row of each state buffer, in [`Checkpoints::state`] order.
    rows: Vec<Vec<f32>>,
}

/// At most one saved state per slot.
pub(crate) struct Checkpoints {
    /// The model's recurrent state buffers (empty for a model without any).
    state: Vec<BufId>,
    saved: Vec<Option<Saved>>,
}

impl Checkpoints {
    pub fn new(spec: &ModelSpec, slots: usize) -> Checkpoints {
        let state = (0..spec.buffers.len())
            .map(|i| BufId(i as u32))
            .filter(|&b| spec.buffer(b).rows == Rows::State)
            .collect();
        Checkpoints {
            state,
            saved: (0..slots).map(|_| None).collect(),
        }
    }

    /// Saves `slot`'s state after `position` tokens, replacing its earlier checkpoint. Nothing
    /// to save at position 0 (every sequence starts from a zero state) or without state.
    pub fn save(&mut self, bufs: &Buffers, slot: usize, position: usize) {
        if self.state.is_empty() || position == 0 {
            self.saved[slot] = None;
            return;
        }
        let rows = self
            .state
            .iter()
            .map(|&b| {
                let row = bufs.row_bytes(b) / 4;
                bufs.get(b).f32s(row * bufs.slots)[slot * row..][..row].to_vec()
            })
            .collect();
        self.saved[slot] = Some(Saved { position, rows });
    }

    /// Cuts `slot` back to at most `pos` tokens: puts back its checkpoint if that was taken at
    /// `pos` or before and returns its position, else forgets it and returns 0 (a restart).
    pub fn restore(&mut self, bufs: &mut Buffers, slot: usize, pos: usize) -> usize {
        match self.saved[slot].take() {
            Some(saved) if saved.position <= pos => {
                for (&b, src) in self.state.iter().zip(&saved.rows) {
                    let row = src.len();
                    let slots = bufs.slots;
                    bufs.get_mut(b).f32s_mut(row * slots)[slot * row..][..row].copy_from_slice(src);
                }
                let position = saved.position;
                // Still valid: the tokens before it have not changed.
                self.saved[slot] = Some(saved);
                position
            }
            _ => 0,
        }
    }

    /// Forgets `slot`'s checkpoint (its sequence restarts).
    pub fn forget(&mut self, slot: usize) {
        self.saved[slot] = None;
    }
}
