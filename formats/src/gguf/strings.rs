//! Arrays of strings in one buffer. A GGUF vocabulary is two arrays of ~150k short strings
//! (`tokenizer.ggml.tokens` and `.merges`); read as a `String` each they were 300k heap
//! allocations, about a fifth of a warm start's CPU time for a GGUF model.

use std::ops::Index;

/// Strings stored back to back; element `i` is `text[ends[i - 1]..ends[i]]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StringArray {
    text: String,
    ends: Vec<usize>,
}

impl StringArray {
    /// An empty array with room for `n` strings of `bytes` bytes in all.
    pub fn with_capacity(n: usize, bytes: usize) -> StringArray {
        StringArray {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.text[start..end])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| &self[i])
    }
}

impl Index<usize> for StringArray {
    type Output = str;
    fn index(&self, i: usize) -> &str {
        self.get(i).expect("a string index within the array")
    }
}

impl<S: AsRef<str>> FromIterator<S> for StringArray {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> StringArray {
        let mut a = StringArray::default();
        for s in iter {
            a.push(s.as_ref());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Elements come back as pushed, empty ones included, in order.
    #[test]
    fn elements_round_trip() {
        let a: StringArray = ["", "ab", "", "é"].into_iter().collect();
        assert_eq!(a.len(), 4);
        assert_eq!(a.iter().collect::<Vec<_>>(), ["", "ab", "", "é"]);
        assert_eq!((&a[1], a.get(4)), ("ab", None));
    }
}
