//! The docs' references to tests are kept true: every test the README or a
//! page under `docs/` names as its proof (written `` `file.rs` `test_name` ``)
//! exists in `tests/tests/file.rs`. A renamed or deleted test fails here
//! instead of leaving a promise that points at nothing.

use std::path::{Path, PathBuf};

use outroute_e2e::workspace;

/// The pages that cite tests: README.md and every Markdown file in docs/.
fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let root = workspace();
    let mut pages = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    Ok(pages)
}

/// Every `` `file.rs` `name` `` in `text`: (file, name). Found by the
/// `` .rs` ` `` between the two, so code blocks and other backticks around
/// do not matter.
fn citations(text: &str) -> Vec<(String, String)> {
    let word = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let mut out = Vec::new();
    for (at, _) in text.match_indices(".rs` `") {
        let Some(file) = text[..at].rsplit('`').next() else {
            continue;
        };
        let after = &text[at + ".rs` `".len()..];
        let Some((name, _)) = after.split_once('`') else {
            continue;
        };
        if word(file) && word(name) {
            out.push((format!("{file}.rs"), name.to_string()));
        }
    }
    out
}

fn defines(test_file: &Path, name: &str) -> bool {
    std::fs::read_to_string(test_file)
        .map(|s| s.contains(&format!("fn {name}(")))
        .unwrap_or(false)
}

#[test]
fn every_test_the_docs_cite_exists() -> anyhow::Result<()> {
    let tests = workspace().join("tests/tests");
    let mut cited = 0;
    let mut missing = Vec::new();
    for page in pages()? {
        let text = std::fs::read_to_string(&page)?;
        for (file, name) in citations(&text) {
            cited += 1;
            if !defines(&tests.join(&file), &name) {
                missing.push(format!("{}: `{file}` `{name}`", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "cited tests that do not exist:\n{}",
        missing.join("\n")
    );
    // The README's producer table alone cites a dozen: finding none means
    // the pattern broke, not that all is well.
    assert!(cited >= 10, "only {cited} citations found");
    Ok(())
}

#[test]
fn citations_are_read_as_written() {
    let text = "```toml\nx = 1\n```\nsee [`store.rs` `a_test`] and `claim.rs` `b_2`, \
                not `x.rs` or `a/b.rs` `c` or `y.rs` `Z` or `z.rs` `…_x_…`";
    assert_eq!(
        citations(text),
        vec![
            ("store.rs".to_string(), "a_test".to_string()),
            ("claim.rs".to_string(), "b_2".to_string()),
        ]
    );
}
