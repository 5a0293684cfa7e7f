//! Errors as operators read them: one line, each cause once.

/// An error and its causes on one line, each cause once: sqlx's database
/// errors repeat their source's text ("…: role \"x\" does not exist: role
/// \"x\" does not exist"), so a cause already ending the text is skipped.
pub fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
