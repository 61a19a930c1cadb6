//! Cache keys: a digest of everything that determines a build output.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::error::CacheError;

/// Number of hexadecimal digits in a key's text form (and in an entry's folder name).
pub const KEY_HEX_LEN: usize = 32;

/// Domain separation for the key digest. Changing the encoding below must change this tag, so a
/// new encoding can never collide with entries written under the old one.
const KEY_DOMAIN: &[u8] = b"kiln-cache-key/v1\0";

/// Identifies one cache entry: the first 128 bits of a SHA-256 over the inputs of a build.
///
/// The cache does not interpret the inputs; callers list everything that changes the build
/// output (spec, versions, CPU, ...) so that a change to any of them selects a different entry
/// instead of reusing a stale library. 128 bits keep folder names short while leaving accidental
/// collisions out of reach.
///
/// The text form is 32 lowercase hexadecimal digits; it is the entry's folder name and what
/// users type on the command line.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key([u8; KEY_HEX_LEN / 2]);

impl Key {
    /// Derives the key of a build from its named inputs.
    ///
    /// The encoding is canonical and unambiguous: pairs are sorted (so call sites need not agree
    /// on an order), and every name and value is prefixed with its length in bytes, so
    /// `("a", "bc")` and `("ab", "c")`, or one pair and two pairs spelling the same bytes, never
    /// produce the same key. Repeated names are allowed and all of them count.
    pub fn from_parts(parts: &[(&str, &str)]) -> Key {
        let mut sorted: Vec<(&str, &str)> = parts.to_vec();
        sorted.sort_unstable();
        let mut hasher = Sha256::new();
        hasher.update(KEY_DOMAIN);
        hasher.update((sorted.len() as u64).to_le_bytes());
        for (name, value) in sorted {
            for text in [name, value] {
                hasher.update((text.len() as u64).to_le_bytes());
                hasher.update(text.as_bytes());
            }
        }
        let digest = hasher.finalize();
        let mut bytes = [0u8; KEY_HEX_LEN / 2];
        bytes.copy_from_slice(&digest[..KEY_HEX_LEN / 2]);
        Key(bytes)
    }

    /// Parses the text form of a key, e.g. a folder name or a command-line argument.
    ///
    /// Accepts exactly [`KEY_HEX_LEN`] hexadecimal digits in either case, so that user input is
    /// validated before it is turned into a path; anything else is a [`CacheError::InvalidKey`].
    pub fn parse(text: &str) -> Result<Key, CacheError> {
        let invalid = || CacheError::InvalidKey { input: text.to_owned() };
        let digits = text.as_bytes();
        if digits.len() != KEY_HEX_LEN {
            return Err(invalid());
        }
        let mut bytes = [0u8; KEY_HEX_LEN / 2];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            let high = hex_value(pair[0]).ok_or_else(invalid)?;
            let low = hex_value(pair[1]).ok_or_else(invalid)?;
            *byte = high << 4 | low;
        }
        Ok(Key(bytes))
    }

    /// The raw 16 bytes of the key, for callers that want to embed it in binary data.
    pub fn as_bytes(&self) -> &[u8; KEY_HEX_LEN / 2] {
        &self.0
    }

    /// Parses a folder name produced by [`Key`]'s `Display`: lowercase only, so that a folder
    /// whose name differs only in case is never taken for an entry (it could not be found by
    /// [`Cache::lookup`](crate::Cache::lookup) anyway).
    pub(crate) fn from_folder_name(name: &str) -> Option<Key> {
        if name.bytes().any(|b| b.is_ascii_uppercase()) {
            return None;
        }
        Key::parse(name).ok()
    }
}

/// Value of one ASCII hexadecimal digit.
fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Lowercase hexadecimal text of `bytes`.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(DIGITS[usize::from(byte >> 4)] as char);
        text.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
    text
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&to_hex(&self.0))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

impl FromStr for Key {
    type Err = CacheError;

    fn from_str(text: &str) -> Result<Key, CacheError> {
        Key::parse(text)
    }
}

impl Serialize for Key {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Key, D::Error> {
        let text = String::deserialize(deserializer)?;
        Key::parse(&text).map_err(serde::de::Error::custom)
    }
}
