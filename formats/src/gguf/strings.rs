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

    /// The array of the strings `bytes[ends[i - 1]..ends[i]]`, `None` unless every one is
    /// UTF-8: the whole is UTF-8 and every end falls on a character boundary (a string that
    /// is not UTF-8 either breaks the whole or cuts a character at one of its ends).
    pub fn from_utf8_parts(bytes: Vec<u8>, ends: Vec<usize>) -> Option<StringArray> {
        let text = String::from_utf8(bytes).ok()?;
        let ordered = ends.windows(2).all(|w| w[0] <= w[1]) && ends.last().is_none_or(|&e| e == text.len());
        (ordered && ends.iter().all(|&e| text.is_char_boundary(e))).then_some(StringArray { text, ends })
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

    /// Built from raw parts, an array holds exactly the valid strings, and any element that is
    /// not UTF-8 on its own is refused even when the concatenation is (a character split
    /// across two elements), as are ends out of order or short of the bytes.
    #[test]
    fn raw_parts_are_checked_element_by_element() {
        let a = StringArray::from_utf8_parts(b"abe\xcc\x81x".to_vec(), vec![0, 2, 5, 6]).unwrap();
        assert_eq!(a.iter().collect::<Vec<_>>(), ["", "ab", "e\u{301}", "x"]);
        let e_acute = "é".as_bytes().to_vec();
        assert!(StringArray::from_utf8_parts(e_acute.clone(), vec![1, 2]).is_none());
        assert!(StringArray::from_utf8_parts(e_acute.clone(), vec![2]).is_some());
        assert!(StringArray::from_utf8_parts(vec![b'a', 0xff], vec![1, 2]).is_none());
        assert!(StringArray::from_utf8_parts(b"abc".to_vec(), vec![2, 1, 3]).is_none());
        assert!(StringArray::from_utf8_parts(b"abc".to_vec(), vec![2]).is_none());
        assert_eq!(
            StringArray::from_utf8_parts(Vec::new(), Vec::new()),
            Some(StringArray::default())
        );
    }
}
