//! Stop strings over streamed text.

/// Watches streamed text for stop strings. Text is passed on as soon as no stop string can
/// start in it: a tail that is the beginning of a stop string is held back until the next piece
/// shows whether the stop string follows. When one appears, the text is cut where it starts and
/// nothing from there on is passed on.
///
/// With no stop strings every piece is passed on at once.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Length in bytes of the longest stop string.
    longest: usize,
    /// All the text so far (cut at the stop string once one is found).
    text: String,
    /// `text[..emitted]` has been passed on.
    emitted: usize,
    /// Index in `stops` of the stop string found.
    matched: Option<usize>,
}

impl StopStrings {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopStrings {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        StopStrings {
            stops,
            longest,
            ..StopStrings::default()
        }
    }

    /// Adds `piece`, passes to `emit` what can no longer be part of a stop string, and returns
    /// whether a stop string has appeared (after which nothing more is accepted).
    pub fn push(&mut self, piece: &str, emit: &mut dyn FnMut(&str)) -> bool {
        if self.matched.is_some() {
            return true;
        }
        self.text.push_str(piece);
        if self.stops.is_empty() {
            self.flush(self.text.len(), emit);
            return false;
        }
        // No stop string starts before `emitted` (a tail that could begin one is never passed
        // on), so searching the rest finds the earliest occurrence.
        let tail = &self.text[self.emitted..];
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| tail.find(s.as_str()).map(|at| (self.emitted + at, i)))
            .min();
        if let Some((at, i)) = found {
            self.flush(at, emit);
            self.text.truncate(at);
            self.matched = Some(i);
            return true;
        }
        let keep = self.held_back();
        self.flush(self.text.len() - keep, emit);
        false
    }

    /// Passes on whatever is held back (the text ended without a stop string).
    pub fn finish(&mut self, emit: &mut dyn FnMut(&str)) {
        self.flush(self.text.len(), emit);
    }

    /// The stop string that was found.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// All the text pushed, cut before the stop string if one was found.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn into_text(self) -> String {
        self.text
    }

    /// Length of the longest tail of the text not yet passed on that is a proper beginning of
    /// a stop string.
    fn held_back(&self) -> usize {
        let pending = self.text.len() - self.emitted;
        let max = pending.min(self.longest.saturating_sub(1));
        (1..=max)
            .rev()
            .filter(|&k| self.text.is_char_boundary(self.text.len() - k))
            .find(|&k| {
                let tail = &self.text[self.text.len() - k..];
                self.stops.iter().any(|s| s.len() > k && s.starts_with(tail))
            })
            .unwrap_or(0)
    }

    fn flush(&mut self, upto: usize, emit: &mut dyn FnMut(&str)) {
        if upto > self.emitted {
            emit(&self.text[self.emitted..upto]);
            self.emitted = upto;
        }
    }
}
