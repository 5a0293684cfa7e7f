//! Last known good team files: each team file `outroute run` accepts is
//! copied beside the plugin cache (`last-good/`), so a team whose file is
//! later refused or missing runs that copy — checked again against today's
//! grant — at once and after a restart.

use super::*;

/// Run team `team`'s last known good copy, if there is one and it still
/// passes (the grant may have changed since). Whether it runs.
pub(super) fn run_last_good(
    state: &mut State,
    team: &str,
    last_good: Option<&Path>,
    main: &str,
    validate: &dyn Fn(&Config) -> Vec<(String, String)>,
) -> bool {
    let Some((file, text)) = last_good.and_then(|d| read_last_good(d, team)) else {
        return false;
    };
    let problems = try_file(state, &file, &text, main, validate);
    if !problems.is_empty() {
        tracing::warn!(
            %team,
            "the last known good copy of team `{team}`'s file no longer passes either: {}",
            problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    problems.is_empty()
}

/// The first line of a last known good copy names the file it was read from.
pub(super) const LAST_GOOD_HEADER: &str = "# outroute: last known good copy of ";

/// Team `team`'s last known good copy under `dir`: the file it was read
/// from (plugin paths resolve against its directory) and its text.
pub(super) fn read_last_good(dir: &Path, team: &str) -> Option<(PathBuf, String)> {
    let text = std::fs::read_to_string(dir.join(format!("{team}.toml"))).ok()?;
    let (first, _) = text.split_once('\n')?;
    let file = PathBuf::from(first.strip_prefix(LAST_GOOD_HEADER)?);
    Some((file, text))
}

/// Keep each accepted team file as its team's last known good copy under
/// `dir` (written only when it changed; atomically).
pub fn remember(dir: &Path, accepted: &[(String, PathBuf, String)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (team, file, text) in accepted {
        let copy = format!("{LAST_GOOD_HEADER}{}\n{text}", file.display());
        let path = dir.join(format!("{team}.toml"));
        if std::fs::read_to_string(&path).is_ok_and(|old| old == copy) {
            continue;
        }
        let tmp = dir.join(format!(".{team}.toml.tmp"));
        std::fs::write(&tmp, copy)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}
