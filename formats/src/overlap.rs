//! Tensors whose bytes overlap.
//!
//! Both file formats place each tensor by offsets into one data section, and nothing in either
//! format stops two entries from pointing at the same bytes: a safetensors header whose
//! `data_offsets` intersect, or a GGUF tensor table where one tensor's offset lands inside
//! another's data (even one of another type). No writer produces such a file (the `safetensors`
//! library refuses shared storage, llama.cpp's writer lays tensors out one after the other), so
//! one is either corrupt or crafted, and reading it would silently run the model on bytes that
//! mean something else. Both front ends reject it with [`first_overlap`].

/// One tensor's bytes: `start..end` (end exclusive) in whatever unit the caller reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span<'a> {
    pub name: &'a str,
    pub start: u64,
    pub end: u64,
}

/// The first pair of spans that share at least one byte, in order of position: `.0` starts no
/// later than `.1` (ties broken by end, then name, so the answer does not depend on the order
/// of the input). Empty spans (`start >= end`) hold no bytes and never overlap anything.
pub fn first_overlap<'a>(spans: impl IntoIterator<Item = Span<'a>>) -> Option<(Span<'a>, Span<'a>)> {
    let mut spans: Vec<Span<'a>> = spans.into_iter().filter(|s| s.start < s.end).collect();
    spans.sort_unstable_by(|a, b| (a.start, a.end, a.name).cmp(&(b.start, b.end, b.name)));
    // Sorted by start, the spans are disjoint exactly when each starts at or after the end of
    // the one before; the first one that does not overlaps its predecessor.
    spans.windows(2).find(|w| w[1].start < w[0].end).map(|w| (w[0], w[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str, start: u64, end: u64) -> Span<'_> {
        Span { name, start, end }
    }

    fn names<'a>(found: Option<(Span<'a>, Span<'a>)>) -> Option<(&'a str, &'a str)> {
        found.map(|(a, b)| (a.name, b.name))
    }

    /// Adjacent, gapped, empty and unsorted spans are not overlaps.
    #[test]
    fn disjoint_spans_pass() {
        assert_eq!(first_overlap([]), None);
        assert_eq!(first_overlap([s("a", 0, 8)]), None);
        assert_eq!(first_overlap([s("b", 8, 16), s("a", 0, 8), s("c", 32, 40)]), None);
        // A zero-size tensor inside or at the edge of another holds no bytes.
        assert_eq!(first_overlap([s("a", 0, 16), s("e", 4, 4), s("f", 16, 16)]), None);
        // Reversed offsets are not this function's concern (the front ends reject them first).
        assert_eq!(first_overlap([s("a", 0, 16), s("r", 8, 4)]), None);
    }

    /// Partial, contained, identical and far-apart-in-input overlaps are all found, named in
    /// position order whatever the input order.
    #[test]
    fn overlaps_are_found_and_named_in_position_order() {
        assert_eq!(names(first_overlap([s("a", 0, 8), s("b", 4, 12)])), Some(("a", "b")));
        assert_eq!(names(first_overlap([s("b", 4, 12), s("a", 0, 8)])), Some(("a", "b")));
        assert_eq!(
            names(first_overlap([s("big", 0, 100), s("in", 40, 60)])),
            Some(("big", "in"))
        );
        assert_eq!(names(first_overlap([s("y", 0, 8), s("x", 0, 8)])), Some(("x", "y")));
        // A span contained in another is found wherever it is listed.
        let found = first_overlap([s("a", 0, 8), s("b", 8, 16), s("c", 20, 24), s("d", 12, 14)]);
        assert_eq!(names(found), Some(("b", "d")));
        // The first overlap by position, not by input order.
        let found = first_overlap([
            s("late1", 100, 108),
            s("late2", 104, 112),
            s("e1", 0, 8),
            s("e2", 6, 10),
        ]);
        assert_eq!(names(found), Some(("e1", "e2")));
        let (a, b) = first_overlap([s("a", 10, 20), s("b", 19, 30)]).unwrap();
        assert_eq!((a.start, a.end, b.start, b.end), (10, 20, 19, 30));
    }

    /// A span swallowing several later ones is reported against the first of them.
    #[test]
    fn a_long_span_over_many_is_reported_once() {
        let found = first_overlap([s("w", 0, 1000), s("p", 10, 20), s("q", 30, 40)]);
        assert_eq!(names(found), Some(("w", "p")));
    }
}
