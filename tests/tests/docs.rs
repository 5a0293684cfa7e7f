//! The docs' references to tests are kept true: every test the README or a
//! page under `docs/` names as its proof (written `` `file.rs` `test_name` ``)
//! exists in `tests/tests/file.rs`. A renamed or deleted test fails here
//! instead of leaving a promise that points at nothing.

use std::path::{Path, PathBuf};

use outroute_e2e::workspace;

/// The pages of the docs: README.md, CONTRIBUTING.md and every Markdown
/// file under docs/src/.
fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let root = workspace();
    let mut pages = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    let mut dirs = vec![root.join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    Ok(pages)
}

/// Every Markdown link target in `text` outside fenced code blocks:
/// `[label](target)`, target as written.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for (at, _) in line.match_indices("](") {
            let rest = &line[at + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
            }
        }
    }
    out
}

/// A heading's anchor as mdBook (and GitHub) make it: lower case, letters,
/// digits, `_` and `-` kept, spaces to `-`, the rest dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_link_between_the_docs_and_the_repository_resolves() -> anyhow::Result<()> {
    let mut checked = 0;
    let mut broken = Vec::new();
    for page in pages()? {
        let text = std::fs::read_to_string(&page)?;
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, fragment) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let path = if file.is_empty() {
                page.clone()
            } else {
                page.parent().map(|d| d.join(file)).unwrap_or_default()
            };
            if !path.exists() {
                broken.push(format!("{}: ({target}): no such file", page.display()));
                continue;
            }
            if let Some(fragment) = fragment {
                let target_text = std::fs::read_to_string(&path).unwrap_or_default();
                if !anchors(&target_text).iter().any(|a| a == fragment) {
                    broken.push(format!("{}: ({target}): no such heading", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked >= 50, "only {checked} links found");
    Ok(())
}

#[test]
fn every_page_of_the_guide_is_in_its_table_of_contents() -> anyhow::Result<()> {
    let src = workspace().join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md"))?;
    let listed = links(&summary);
    let mut orphans = Vec::new();
    for page in pages()? {
        let Ok(relative) = page.strip_prefix(&src) else {
            continue;
        };
        let relative = relative.to_string_lossy().to_string();
        if relative != "SUMMARY.md" && !listed.contains(&relative) {
            orphans.push(relative);
        }
    }
    assert!(
        orphans.is_empty(),
        "pages not in docs/src/SUMMARY.md: {orphans:?}"
    );
    Ok(())
}

#[test]
fn anchors_and_links_are_read_as_written() {
    assert_eq!(
        anchor(" What `scripts/bench` measures"),
        "what-scriptsbench-measures"
    );
    assert_eq!(
        anchor("One part down never stops the rest"),
        "one-part-down-never-stops-the-rest"
    );
    assert_eq!(
        links("see [a](x.md#b) and [c](../d.md)\n```\n[e](f.md)\n```\n[g](h.md)"),
        vec!["x.md#b", "../d.md", "h.md"]
    );
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
    // The guide's producer table alone cites a dozen: finding none means
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
