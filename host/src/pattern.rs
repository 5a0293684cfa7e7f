//! Name and topic patterns, as routes, grants and allow-lists write them:
//! their syntax (checked when a config is loaded) and their matching.
//! A name pattern (aggregate type, event type) is a plain glob; in a
//! topic/subject pattern `*` stops at `.` and `**` does not.

use globset::{GlobBuilder, GlobMatcher};

/// Compile a topic/subject pattern: `*` is any run of characters except
/// `.`, `**` is anything (including `.`), everything else is literal.
pub fn topic_matcher(pattern: &str) -> Result<GlobMatcher, String> {
    if pattern.is_empty() {
        return Err("empty topic pattern".into());
    }
    // globset separates on '/'; topics on '.'. Swap so `*` stops at dots.
    let swapped = pattern.replace('/', "\u{1}").replace('.', "/");
    GlobBuilder::new(&swapped)
        .literal_separator(true)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("bad topic pattern `{pattern}`: {e}"))
}

/// Compile a name pattern (aggregate type, event type): plain glob.
pub fn name_matcher(pattern: &str) -> Result<GlobMatcher, String> {
    GlobBuilder::new(pattern)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("bad pattern `{pattern}`: {e}"))
}

/// A topic as [`topic_matcher`]'s matchers see it.
pub fn topic_key(topic: &str) -> String {
    topic.replace('/', "\u{1}").replace('.', "/")
}
