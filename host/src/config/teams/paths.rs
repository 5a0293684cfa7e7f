//! Where a team's files may be: `include` patterns expanded to files, and
//! plugin paths resolved (after `..` and symlinks) and confined to the team
//! file's directory or a grant's `plugin_dirs`.

use super::*;

/// The files `include` names, in order (`dir/*.toml` style: wildcards in
/// the file name only), relative to `base`.
pub(super) fn expand(base: &Path, pattern: &str) -> Result<Vec<PathBuf>, String> {
    let full = if Path::new(pattern).is_absolute() {
        PathBuf::from(pattern)
    } else {
        base.join(pattern)
    };
    let (Some(dir), Some(name)) = (full.parent(), full.file_name()) else {
        return Err(format!("`{pattern}` names no file"));
    };
    let name = name.to_string_lossy();
    if dir.to_string_lossy().contains(['*', '?', '[']) {
        return Err(format!(
            "`{pattern}`: wildcards are allowed in the file name only"
        ));
    }
    if !name.contains(['*', '?', '[']) {
        return if full.is_file() {
            Ok(vec![full])
        } else {
            Err(format!("{} does not exist", full.display()))
        };
    }
    let glob = globset::Glob::new(&name)
        .map_err(|e| format!("`{pattern}`: {e}"))?
        .compile_matcher();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| glob.is_match(n)))
        .collect();
    out.sort();
    Ok(out)
}

/// `path` as the file system resolves it: symlinks and `..` followed as
/// far as the path exists (a plugin file may not be there yet), the rest
/// taken as written.
pub(super) fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let mut rest = Vec::new();
    let mut at = path;
    while let Some(parent) = at.parent() {
        if let Some(name) = at.file_name() {
            rest.push(name.to_os_string());
        } else {
            // `..` or a root: cannot be taken apart without resolving.
            break;
        }
        if let Ok(p) = std::fs::canonicalize(parent) {
            return rest.iter().rev().fold(p, |p, n| p.join(n));
        }
        at = parent;
    }
    path.to_path_buf()
}

/// Is `path` (resolved) inside one of `dirs` (resolved)? A path with a
/// `..` left after resolving is never inside.
pub(super) fn confined(path: &Path, dirs: &[PathBuf]) -> bool {
    let p = resolved(path);
    if p.components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return false;
    }
    dirs.iter().any(|d| p.starts_with(resolved(d)))
}
