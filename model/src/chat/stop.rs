//! Stop strings over streamed text, with OpenAI's semantics: the text ends just before the
//! first stop string, which itself is not returned. Text given with
//! [`StopMatcher::push_unmatched`] (before vLLM's `min_tokens`) ends nothing: only a stop
//! string that ends in later text counts (it may start in the earlier).

/// Finds a request's stop strings in text that arrives in pieces: the text stops at the
/// first place where a stop string ends (of two ending there, the longer is dropped). It holds back only the end
/// of the text that could still be the start of a stop string, so everything it returns is
/// final; it works on `str`, so it never splits a character (give it text decoded with a
/// UTF-8-safe stream, such as a [`super::Detok`]).
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received and not yet returned: a suffix that is a prefix of some stop string.
    held: String,
    /// The stop string found, by index.
    matched: Option<usize>,
    /// Bytes of `held` that no stop string may end in (given with `push_unmatched`).
    floor: usize,
}

impl StopMatcher {
    /// A matcher for these stop strings (empty ones are ignored).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
            floor: 0,
        }
    }

    /// Takes the next piece of text; returns what is safe to emit now, and whether a stop
    /// string has been found (then the text up to it is returned and the rest, stop string
    /// included, dropped; later pushes return nothing).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.matched.is_some() {
            return (String::new(), true);
        }
        self.held.push_str(text);
        // The stop string that ends first (then the one that starts first): what the text
        // shows as it grows, so the result does not depend on how it was cut into pieces.
        let (held, floor) = (&self.held, self.floor);
        let first = (self.stops.iter().enumerate())
            .filter_map(|(i, s)| first_ending_after(held, s, floor).map(|at| (at + s.len(), at, i)))
            .min();
        if let Some((_, at, i)) = first {
            self.held.truncate(at);
            self.matched = Some(i);
            return (std::mem::take(&mut self.held), true);
        }
        (self.emit(), false)
    }

    /// Takes the next piece of text, which no stop string may end in (a stop string that starts
    /// in it and ends in later text still counts); returns what is safe to emit now.
    pub fn push_unmatched(&mut self, text: &str) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        self.held.push_str(text);
        self.floor = self.held.len();
        self.emit()
    }

    /// Returns the held text but the end that could start a stop string.
    fn emit(&mut self) -> String {
        let cut = self.held.len() - self.held_back_len();
        self.floor = self.floor.saturating_sub(cut);
        self.held.drain(..cut).collect()
    }

    /// The length of the longest end of the held text that is the start of a stop string
    /// (always a character boundary: a stop string starts with a whole character).
    fn held_back_len(&self) -> usize {
        let h = self.held.as_bytes();
        self.stops
            .iter()
            .map(|s| {
                let s = s.as_bytes();
                (1..s.len().min(h.len() + 1)).rev().find(|&n| h[h.len() - n..] == s[..n]).unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string found, if one was.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The end of the text: what was held back (nothing after a stop).
    pub fn finish(self) -> String {
        if self.stopped() { String::new() } else { self.held }
    }
}

/// Where the first occurrence of `s` in `held` that ends past byte `floor` starts.
fn first_ending_after(held: &str, s: &str, floor: usize) -> Option<usize> {
    let from = (floor + 1).saturating_sub(s.len());
    (from..=held.len().saturating_sub(s.len())).find(|&at| held.is_char_boundary(at) && held[at..].starts_with(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of cutting `text` into pieces at character boundaries (up to three cuts).
    fn splits(text: &str) -> Vec<Vec<&str>> {
        let cuts: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        let mut out = vec![vec![text]];
        for (i, &a) in cuts.iter().enumerate() {
            out.push(vec![&text[..a], &text[a..]]);
            for (j, &b) in cuts.iter().enumerate().skip(i + 1) {
                out.push(vec![&text[..a], &text[a..b], &text[b..]]);
                for &c in &cuts[j + 1..] {
                    out.push(vec![&text[..a], &text[a..b], &text[b..c], &text[c..]]);
                }
            }
        }
        out
    }

    /// The text let through and the stop string found.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        let mut stopped = false;
        for p in pieces {
            let (emit, s) = m.push(p);
            // Nothing is returned that the whole text would not have returned.
            out.push_str(&emit);
            stopped = s;
        }
        let matched = m.matched().map(str::to_string);
        assert_eq!(stopped, matched.is_some());
        out.push_str(&m.finish());
        (out, matched)
    }

    #[test]
    fn any_split_gives_the_whole_text_result() {
        let cases: [(&[&str], &str, &str, Option<&str>); 9] = [
            (&["abcd", "bc"], "abcd", "a", Some("bc")),
            (&["STOP"], "abSTOPcd", "ab", Some("STOP")),
            (&["STOP"], "abSTOcd", "abSTOcd", None),
            (&["ab", "b"], "xaab", "xa", Some("ab")),
            (&["b", "ab"], "xaab", "xa", Some("ab")),
            (&["é!"], "caféé!x", "café", Some("é!")),
            (&["日本"], "日日本語", "日", Some("日本")),
            (&["<|im_end|>", "\n\n"], "a\nb<|im_", "a\nb<|im_", None),
            (&["", "c"], "abc", "ab", Some("c")),
        ];
        for (stops, text, want, stop) in cases {
            for pieces in splits(text) {
                let expected = (want.to_string(), stop.map(str::to_string));
                assert_eq!(run(stops, &pieces), expected, "stops {stops:?}, pieces {pieces:?}");
            }
        }
    }

    /// Text pushed unmatched ends nothing, whatever stop strings it holds; a stop string that
    /// starts in it and ends after it does.
    #[test]
    fn unmatched_text_ends_nothing() {
        let stops = ["STOP".to_string(), "ab".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push_unmatched("xSTOPyab"), "xSTOPyab");
        assert_eq!(m.push_unmatched("STO"), "", "held: it may start a stop string");
        assert_eq!(m.push("P!"), (String::new(), true), "`STOP` began in unmatched text, ends after it");
        assert_eq!(m.matched(), Some("STOP"));
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push_unmatched("a"), "", "held");
        assert_eq!(m.push_unmatched("b"), "ab", "`ab` ended in unmatched text: nothing");
        assert_eq!(m.push("c ab"), ("c ".to_string(), true));
        let mut m = StopMatcher::new(&["aa".to_string()]);
        assert_eq!(m.push_unmatched("aa"), "a");
        assert_eq!(m.push("a"), (String::new(), true), "the overlapping `aa` ending after");
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push_unmatched("日本"), "日本");
        assert_eq!(m.push("xy"), ("xy".to_string(), false));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn holds_back_only_a_possible_start() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        assert_eq!(m.push("abc</e"), ("abc".to_string(), false));
        assert_eq!(m.push("x"), ("</ex".to_string(), false));
        assert_eq!(m.push("</end>tail"), (String::new(), true));
        assert_eq!(m.push("more"), (String::new(), true));
        assert!(m.stopped());
        assert_eq!(m.finish(), "");
    }
}
