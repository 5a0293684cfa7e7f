//! Tests of loading, overrides, validation and redaction.
//!
//! One concern, one file: the unit tests of loading a configuration (files,
//! overrides, team files, secrets, validation); each is short, there are
//! many.

use super::*;

#[test]
fn key_paths_are_spelled_as_in_the_other_messages() {
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        super::key_of(&path(&["routes", "0", "aggregate_types"])),
        "routes[0].aggregate_types"
    );
    assert_eq!(super::key_of(&path(&["relay", "lanes"])), "relay.lanes");
}

fn write(dir: &Path, body: &str) -> PathBuf {
    let f = dir.join("outroute.toml");
    std::fs::write(&f, body).unwrap();
    std::fs::write(dir.join("p.wasm"), b"\0asm").unwrap();
    f
}

fn tmp() -> PathBuf {
    let d = std::env::temp_dir().join(format!("outroute-cfg-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const GOOD: &str = r#"
[store]
url = "postgres://root@127.0.0.1/test"
[sinks.kafka]
kind = "kafka"
brokers = "127.0.0.1:9092"
[plugins.p]
path = "p.wasm"
[[routes]]
name = "orders"
plugin = "p"
allow = { kafka = ["orders.*"] }
"#;

const PLATFORM: &str = r#"
include = ["teams/*.toml"]
[sources.orders]
url = "postgres://root@127.0.0.1/orders"
[sources.billing]
url = "postgres://root@127.0.0.1/billing"
[sinks.kafka]
kind = "kafka"
brokers = "127.0.0.1:9092"
[grants.payments]
sources = ["orders"]
allow = { kafka = ["payments.*"] }
plugin_dirs = ["."]
"#;

fn team_file(dir: &Path, name: &str, body: &str) {
    std::fs::create_dir_all(dir.join("teams")).unwrap();
    std::fs::write(dir.join("teams").join(name), body).unwrap();
}

const PAYMENTS: &str = "team = \"payments\"\n[plugins.pay]\npath = \"../p.wasm\"\n\
    [[routes]]\nname = \"pay\"\nplugin = \"pay\"\nallow = { kafka = [\"payments.*\"] }\n";

/// Every problem: the refused team files' (the load goes on without
/// them) and the main file's (the load is refused).
fn problems(f: &Path) -> Vec<ConfigError> {
    match load(f) {
        Ok(l) => l.refused.into_iter().flat_map(|r| r.problems).collect(),
        Err(e) => e.0,
    }
}

#[test]
fn team_files_merge_within_their_grant() {
    let d = tmp();
    let f = write(&d, PLATFORM);
    team_file(&d, "payments.toml", PAYMENTS);
    let l = load(&f).unwrap();
    assert_eq!(l.files.len(), 2);
    let r = &l.config.routes[0];
    assert_eq!(r.sources, vec!["orders".to_string()], "the grant's sources");
    assert!(l.config.plugins["pay"].path.is_absolute());
    assert!(!l.config.store_shorthand);
}

#[test]
fn team_files_cannot_reach_outside_their_grant() {
    let d = tmp();
    let f = write(&d, PLATFORM);
    let team = d.join("teams/payments.toml").display().to_string();
    let cases = [
        (
            PAYMENTS.replace("payments.*\"]", "orders.*\"]"),
            "routes[0].allow.kafka",
            "outside team `payments`'s grant",
        ),
        (
            format!("{PAYMENTS}sources = [\"billing\"]\n"),
            "routes[0].sources",
            "source `billing` is outside",
        ),
        (
            PAYMENTS.replace("payments\"\n[plugins", "ghosts\"\n[plugins"),
            "team",
            "this file says team `ghosts`, but a team file must be named after its team",
        ),
        (
            format!("{PAYMENTS}[sinks.mine]\nkind = \"file\"\npath = \"x\"\n"),
            "sinks",
            "a team file declares `team`, `plugins` and `routes` only",
        ),
        (
            PAYMENTS.replace("plugin = \"pay\"", "plugin = \"other\""),
            "routes[0].plugin",
            "not declared in this file",
        ),
    ];
    for (body, key, reason) in cases {
        team_file(&d, "payments.toml", &body);
        let p = problems(&f);
        assert!(
            p.iter()
                .any(|e| e.file == team && e.key == key && e.reason.contains(reason)),
            "{key}: {p:?}"
        );
    }
    // A team without a grant.
    team_file(&d, "payments.toml", PAYMENTS);
    team_file(
        &d,
        "ghosts.toml",
        &PAYMENTS.replace("payments\"\n[plugins", "ghosts\"\n[plugins"),
    );
    let p = problems(&f);
    assert!(
        p.iter()
            .any(|e| e.key == "team" && e.reason.contains("team `ghosts` has no grant")),
        "{p:?}"
    );
    std::fs::remove_file(d.join("teams/ghosts.toml")).unwrap();
    // Another file's route name is not a team's to take.
    let f = write(
        &d,
        &format!(
            "{PLATFORM}[grants.billing]\nsources = [\"billing\"]\nallow = {{ kafka = [\"billing.*\"] }}\nplugin_dirs = [\".\"]\n"
        ),
    );
    team_file(
        &d,
        "billing.toml",
        "team = \"billing\"\n[plugins.bill]\npath = \"../p.wasm\"\n\
         [[routes]]\nname = \"pay\"\nplugin = \"bill\"\nallow = { kafka = [\"billing.*\"] }\n",
    );
    let p = problems(&f);
    assert!(
        p.iter()
            .any(|e| e.key == "routes[0].name" && e.reason.contains("already declared by")),
        "{p:?}"
    );
}

#[test]
fn team_plugin_files_stay_in_the_teams_directories() {
    let d = tmp();
    // No `plugin_dirs`: only the team file's own directory.
    let f = write(&d, &PLATFORM.replace("plugin_dirs = [\".\"]\n", ""));
    let team = d.join("teams/payments.toml").display().to_string();
    let outside = std::env::temp_dir().join("outroute-not-the-teams");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::create_dir_all(d.join("teams")).unwrap();
    let link = d.join("teams/linked");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    for path in [
        "../p.wasm".to_string(),
        outside.join("p.wasm").display().to_string(),
        "linked/p.wasm".to_string(),
        "sub/../../p.wasm".to_string(),
    ] {
        team_file(&d, "payments.toml", &PAYMENTS.replace("../p.wasm", &path));
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.file == team
                && e.key == "plugins.pay.path"
                && e.reason.contains("outside team `payments`'s directories")),
            "{path}: {p:?}"
        );
    }
    // The shadow too.
    team_file(
        &d,
        "payments.toml",
        &PAYMENTS.replace(
            "path = \"../p.wasm\"",
            "path = \"p.wasm\"\nshadow = \"../cand.wasm\"",
        ),
    );
    let p = problems(&f);
    assert!(p.iter().any(|e| e.key == "plugins.pay.shadow"), "{p:?}");
    // Inside the team's directory (a file not there yet included), or
    // one its grant names: accepted.
    team_file(
        &d,
        "payments.toml",
        &PAYMENTS.replace("../p.wasm", "plugins/p.wasm"),
    );
    assert!(load(&f).unwrap().refused.is_empty());
    let f = write(&d, PLATFORM);
    team_file(&d, "payments.toml", PAYMENTS);
    assert!(load(&f).unwrap().refused.is_empty());
}

#[test]
fn a_grant_bounds_the_events_a_team_reads() {
    let d = tmp();
    let f = write(
        &d,
        &PLATFORM.replace(
            "sources = [\"orders\"]\n",
            "sources = [\"orders\"]\naggregate_types = [\"payment*\"]\n",
        ),
    );
    // The default selection reads exactly what the grant allows.
    team_file(&d, "payments.toml", PAYMENTS);
    let l = load(&f).unwrap();
    assert!(l.refused.is_empty(), "{:?}", l.refused);
    let route = l.config.routes.iter().find(|r| r.name == "pay").unwrap();
    assert_eq!(route.aggregate_types, ["payment*"]);
    // A narrower selection is the team's to make.
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}aggregate_types = [\"payment.refund\"]\n"),
    );
    assert!(load(&f).unwrap().refused.is_empty());
    // Another team's events are not.
    let team = d.join("teams/payments.toml").display().to_string();
    for pats in ["\"order\"", "\"payment\", \"*\""] {
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}aggregate_types = [{pats}]\n"),
        );
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.file == team
                && e.key == "routes[0].aggregate_types"
                && e.reason.contains("outside team `payments`'s grant")),
            "{pats}: {p:?}"
        );
    }
}

#[test]
fn a_grant_bounds_the_event_types_a_team_reads() {
    let d = tmp();
    let f = write(
        &d,
        &PLATFORM.replace(
            "sources = [\"orders\"]\n",
            "sources = [\"orders\"]\nevent_types = [\"payment.*\"]\n",
        ),
    );
    team_file(&d, "payments.toml", PAYMENTS);
    let l = load(&f).unwrap();
    assert!(l.refused.is_empty(), "{:?}", l.refused);
    assert_eq!(l.config.routes[0].event_types, ["payment.*"]);
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}event_types = [\"payment.refunded\"]\n"),
    );
    assert!(load(&f).unwrap().refused.is_empty());
    // `*`, written out, is the default: it reads the grant's.
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}event_types = [\"*\"]\n"),
    );
    let l = load(&f).unwrap();
    assert!(l.refused.is_empty(), "{:?}", l.refused);
    assert_eq!(l.config.routes[0].event_types, ["payment.*"]);
    let team = d.join("teams/payments.toml").display().to_string();
    for pats in ["\"order.created\"", "\"payment.*\", \"order.*\""] {
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}event_types = [{pats}]\n"),
        );
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.file == team
                && e.key == "routes[0].event_types"
                && e.reason
                    .contains("outside team `payments`'s grant (event_types: payment.*)")),
            "{pats}: {p:?}"
        );
    }
}

#[test]
fn only_an_owner_keeps_events_from_copies() {
    let d = tmp();
    let owner = PLATFORM.replace(
        "sources = [\"orders\"]\n",
        "sources = [\"orders\"]\nowns = [\"payment*\"]\n",
    );
    let f = write(&d, &owner);
    let team = d.join("teams/payments.toml").display().to_string();
    // Exclusive over what the team owns (its default selection, or a
    // narrower one): accepted.
    for extra in [
        "aggregate_types = [\"payment\"]\n",
        "aggregate_types = [\"payment.*\"]\n",
    ] {
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}exclusive = true\n{extra}"),
        );
        let l = load(&f).unwrap();
        assert!(l.refused.is_empty(), "{extra}: {:?}", l.refused);
        assert!(l.config.routes[0].exclusive);
    }
    // Over anything it does not own (here, its default selection: every
    // event of the source): refused, naming the key.
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}exclusive = true\n"),
    );
    let p = problems(&f);
    assert!(
        p.iter().any(|e| e.file == team
            && e.key == "routes[0].exclusive"
            && e.reason
                .contains("pattern `*` is not owned by team `payments`")),
        "{p:?}"
    );
    // A team that owns nothing cannot be exclusive at all.
    let f = write(&d, PLATFORM);
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}exclusive = true\naggregate_types = [\"payment\"]\n"),
    );
    let p = problems(&f);
    assert!(
        p.iter().any(|e| e.key == "routes[0].exclusive"
            && e.reason
                .contains("owns no aggregate types (grants.payments.owns)")),
        "{p:?}"
    );
    // An aggregate type has one owner; and a team owns only what it
    // may read.
    let f = write(
        &d,
        &format!(
            "{owner}[grants.billing]\nsources = [\"orders\"]\nowns = [\"payment\"]\n\
             [grants.audit]\nsources = [\"orders\"]\naggregate_types = [\"audit\"]\nowns = [\"order\"]\n"
        ),
    );
    let p = load(&f).unwrap_err().0;
    assert!(
        p.iter().any(|e| e.key == "grants.payments.owns"
            && e.reason
                .contains("`payment*` overlaps `payment`, owned by team `billing`")),
        "{p:?}"
    );
    assert!(
        p.iter().any(|e| e.key == "grants.audit.owns"
            && e.reason
                .contains("`order` is outside what team `audit` may read")),
        "{p:?}"
    );
}

#[test]
fn team_routes_stay_under_their_grants_ceilings_and_grants_under_the_relays() {
    let d = tmp();
    let f = write(&d, PLATFORM);
    let team = d.join("teams/payments.toml").display().to_string();
    let refused = |body: &str| {
        team_file(&d, "payments.toml", body);
        problems(&f)
    };
    // The issue's example: a minute of CPU per event, never quarantined.
    let p = refused(&format!(
        "{PAYMENTS}cpu_budget = \"60s\"\nquarantine_after = 4000000000\n"
    ));
    for (key, needle) in [
        (
            "routes[0].cpu_budget",
            "\"1m\" is above team `payments`'s ceiling \"1s\"",
        ),
        ("routes[0].quarantine_after", "4000000000 is above"),
    ] {
        assert!(
            p.iter()
                .any(|e| e.file == team && e.key == key && e.reason.contains(needle)),
            "{key}: {p:?}"
        );
    }
    // Never quarantining is no team's choice.
    let p = refused(&format!("{PAYMENTS}quarantine_after = 0\n"));
    assert!(p.iter().any(|e| e.reason.contains("0 (never)")), "{p:?}");
    // Within the built-in maxima: accepted.
    assert!(
        refused(&format!(
            "{PAYMENTS}cpu_budget = \"500ms\"\nmemory_mib = 256\n"
        ))
        .is_empty()
    );
    // A grant lowers them for its team...
    let f = write(
        &d,
        &PLATFORM.replace(
            "allow = { kafka = [\"payments.*\"] }",
            "allow = { kafka = [\"payments.*\"] }\nceilings = { memory_mib = 128 }",
        ),
    );
    team_file(
        &d,
        "payments.toml",
        &format!("{PAYMENTS}memory_mib = 256\n"),
    );
    let p = problems(&f);
    assert!(
        p.iter().any(|e| e.key == "routes[0].memory_mib"
            && e.reason
                .contains("256 is above team `payments`'s ceiling 128")),
        "{p:?}"
    );
    // ...and cannot raise them above the relay's: the main file is refused.
    let f = write(
        &d,
        &format!(
            "{}[relay]\nroute_ceilings = {{ memory_mib = 256 }}\n",
            PLATFORM.replace(
                "allow = { kafka = [\"payments.*\"] }",
                "allow = { kafka = [\"payments.*\"] }\nceilings = { memory_mib = 1024 }",
            )
        ),
    );
    team_file(&d, "payments.toml", PAYMENTS);
    let e = load(&f).err().map(|e| e.0).unwrap_or_default();
    assert!(
        e.iter()
            .any(|e| e.key == "grants.payments.ceilings.memory_mib"
                && e.reason.contains("1024 is above the relay's ceiling 256")),
        "{e:?}"
    );
}

#[test]
fn a_refused_team_file_costs_only_its_team_which_runs_its_last_known_good_copy() {
    let d = tmp();
    let main = format!(
        "{PLATFORM}[relay]\ncache_dir = \"{}\"\n\
         [grants.billing]\nsources = [\"billing\"]\nallow = {{ kafka = [\"billing.*\"] }}\nplugin_dirs = [\".\"]\n",
        d.join("cache").display()
    );
    let f = write(&d, &main);
    let billing = "team = \"billing\"\n[plugins.bill]\npath = \"../p.wasm\"\n\
         [[routes]]\nname = \"bill\"\nplugin = \"bill\"\nallow = { kafka = [\"billing.*\"] }\n";
    team_file(&d, "payments.toml", PAYMENTS);
    team_file(&d, "billing.toml", billing);
    let routes = |l: &Loaded| {
        let mut r: Vec<String> = l.config.routes.iter().map(|r| r.name.clone()).collect();
        r.sort();
        r
    };
    let good = load(&f).unwrap();
    assert!(good.refused.is_empty(), "{:?}", good.refused);
    assert_eq!(routes(&good), ["bill", "pay"]);
    // Without a copy kept, a broken file takes its team's routes out
    // (their events wait), never the other team's.
    team_file(
        &d,
        "payments.toml",
        "team = \"payments\"\n[[routes]\nbroken",
    );
    let l = load(&f).unwrap();
    assert_eq!(routes(&l), ["bill"]);
    assert_eq!(l.refused.len(), 1);
    assert!(!l.refused[0].last_good);
    assert!(l.refused_lines()[0].contains("teams/payments.toml refused (its routes do not run"));
    // Kept once accepted (as `run` does), the copy runs in its place:
    // at the next load, as after a restart.
    good.remember_good_teams();
    let l = load(&f).unwrap();
    assert_eq!(routes(&l), ["bill", "pay"]);
    assert!(l.refused[0].last_good, "{:?}", l.refused);
    assert!(l.config.plugins["pay"].path.ends_with("p.wasm"));
    // A file claiming another team's name is refused; that team is
    // untouched.
    team_file(&d, "payments.toml", PAYMENTS);
    team_file(
        &d,
        "rogue.toml",
        &billing.replace("billing\"\n[plugins", "payments\"\n[plugins"),
    );
    let l = load(&f).unwrap();
    assert_eq!(routes(&l), ["bill", "pay"]);
    assert_eq!(l.refused.len(), 1);
    assert_eq!(l.refused[0].problems[0].key, "team");
    // A granted team whose file went missing runs its copy, and says so.
    std::fs::remove_file(d.join("teams/rogue.toml")).unwrap();
    std::fs::remove_file(d.join("teams/payments.toml")).unwrap();
    let l = load(&f).unwrap();
    assert_eq!(routes(&l), ["bill", "pay"]);
    assert!(
        l.refused[0].problems[0]
            .reason
            .contains("has a grant but no team file")
    );
    // A copy the grant no longer allows does not run.
    let narrower = main.replace(
        "allow = { kafka = [\"payments.*\"] }",
        "allow = { kafka = [\"pay.*\"] }",
    );
    let f = write(&d, &narrower);
    let l = load(&f).unwrap();
    assert_eq!(routes(&l), ["bill"]);
    // The main file's own problems still refuse the whole config.
    let f = write(
        &d,
        &main.replace("[sinks.kafka]", "[sinks.kafka]\nmax_in_flight = 0"),
    );
    assert!(load(&f).is_err());
}

#[test]
fn diff_names_what_changes_and_which_sources() {
    let d = tmp();
    let f = write(&d, PLATFORM);
    team_file(&d, "payments.toml", PAYMENTS);
    let old = load(&f).unwrap();
    let d2 = tmp();
    let f2 = write(
        &d2,
        &format!(
            "{}\n[relay]\nbatch_size = 10\n",
            PLATFORM.replace("billing", "invoices")
        ),
    );
    team_file(
        &d2,
        "payments.toml",
        &PAYMENTS.replace("payments.*\"]", "payments.x\"]"),
    );
    let new = load(&f2).unwrap();
    let diff = super::diff(&old.config, &new.config);
    assert_eq!(diff.sources.added, vec!["invoices".to_string()]);
    assert_eq!(diff.sources.removed, vec!["billing".to_string()]);
    assert_eq!(diff.routes.changed, vec!["pay".to_string()]);
    assert_eq!(diff.restart, vec!["relay.batch_size".to_string()]);
    assert_eq!(
        diff.affected_sources,
        vec!["invoices".to_string(), "orders".to_string()]
    );
    let same = super::diff(&old.config, &old.config);
    assert!(same.is_empty() && same.affected_sources.is_empty());
}

#[test]
fn good_config_loads() {
    let d = tmp();
    let l = load(&write(&d, GOOD)).unwrap();
    assert_eq!(l.config.routes[0].max_attempts, 10);
    // The canonical table, listed in the pending queue on PostgreSQL.
    let table = l.config.sources["default"].table();
    assert_eq!(
        table.marking,
        Marking::Queue {
            column: Some("published_at".into())
        }
    );
    assert_eq!(
        TableConfig {
            marking: Marking::default(),
            ..table
        },
        TableConfig::canonical()
    );
}

#[test]
fn errors_name_file_key_and_reason() {
    let d = tmp();
    let body = GOOD
        .replace("plugin = \"p\"", "plugin = \"nope\"")
        .replace("kafka = [", "kafak = [");
    let errs = load(&write(&d, &body)).unwrap_err();
    let text = errs.to_string();
    assert!(
        text.contains("outroute.toml:routes[0].plugin: no plugin named `nope`"),
        "{text}"
    );
    assert!(
        text.contains("outroute.toml:routes[0].allow.kafak: no sink named `kafak`"),
        "{text}"
    );
}

/// A MySQL source loads in lease or binlog mode, on the canonical table or
/// a mapped one; what it cannot do (logical capture, `tls`, `queue`
/// marking, constants that would need escaping) is refused by key, and so
/// is binlog capture on PostgreSQL.
#[test]
fn a_mysql_source_is_checked_for_what_it_supports() {
    let d = tmp();
    let good = GOOD.replace(
        "postgres://root@127.0.0.1/test",
        "mysql://root@127.0.0.1:3306/test",
    );
    assert!(load(&write(&d, &good)).is_ok());
    let table = "[store.table]\nname = \"t_outbox\"\nid = \"id\"\n\
         aggregate_type = \"aggregate_type\"\naggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\n\
         payload = \"payload\"\ncreated_at = \"created_at\"\n";
    let mapped = good.replace(
        "[sinks.kafka]",
        &format!(
            "{table}marking = {{ style = \"status\", column = \"status\", pending = \"PENDING\", sent = \"SENT\" }}\n[sinks.kafka]"
        ),
    );
    assert!(load(&write(&d, &mapped)).is_ok());
    let bad = good.replace(
        "[sinks.kafka]",
        &format!(
            "capture = \"logical\"\ntls = {{ mode = \"require\" }}\n{table}marking = {{ style = \"queue\" }}\n[sinks.kafka]"
        ),
    );
    let text = load(&write(&d, &bad)).unwrap_err().to_string();
    for needle in [
        "outroute.toml:store.table.marking: `queue` fills its list by an insert trigger, on PostgreSQL only",
        "outroute.toml:store.capture: `logical` is PostgreSQL's replication slot; MySQL/MariaDB sources use `lease` or `binlog`",
        "outroute.toml:store.tls: is for PostgreSQL",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in {text}");
    }
    // Binlog capture: MySQL/MariaDB's, on either table shape; not PostgreSQL's.
    let binlog = |cfg: &str| cfg.replace("[sinks.kafka]", "capture = \"binlog\"\n[sinks.kafka]");
    assert!(load(&write(&d, &binlog(&good))).is_ok());
    let text = load(&write(&d, &binlog(GOOD))).unwrap_err().to_string();
    assert!(
        text.contains("outroute.toml:store.capture: `binlog` reads MySQL/MariaDB's binary log"),
        "{text}"
    );
    let quoted = mapped.replace("\"SENT\"", "\"SENT' OR '1\"");
    let text = load(&write(&d, &quoted)).unwrap_err().to_string();
    assert!(
        text.contains("store.table.marking.sent: `SENT' OR '1` holds a quote or a backslash"),
        "{text}"
    );
}

/// Values that load and parse but would start a relay that publishes
/// nothing, logs nothing, or fails every event: refused by name.
#[test]
fn values_that_would_start_a_broken_relay_are_refused() {
    let d = tmp();
    let body = GOOD
        .replace(
            "[store]",
            "[http]\nlisten = \":99999\"\n[log]\nlevel = \"verbose\"\n[relay]\nmax_batch_bytes = 0\npublish_timeout = \"0s\"\nreconcile_every = \"500ms\"\n[store]",
        )
        .replace(
            "[plugins.p]",
            "[sinks.nats]\nkind = \"nats\"\nurl = \"nats:/127.0.0.1:4222\"\nmax_in_flight = 0\n\
             create_stream = { name = \"S\", subjects = [\"orders..x\"] }\n[plugins.p]",
        )
        .replace(
            "allow = { kafka = [\"orders.*\"] }",
            "allow = { kafka = [\"orders/*\", \"orders.{a,b}-?\"], nats = [\"orders.>\"] }\nmax_messages_per_event = 0",
        )
        .replace(
            "url = \"postgres://root@127.0.0.1/test\"",
            "url = \"postgres://root@127.0.0.1/test\"\nmax_connections = 0",
        );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    for expected in [
        "outroute.toml:relay.max_batch_bytes: must be positive",
        "outroute.toml:relay.publish_timeout: must be positive",
        "outroute.toml:relay.reconcile_every: must be at least 1s",
        "outroute.toml:log.level: `verbose`: `verbose` is not a level",
        "outroute.toml:sinks.nats.url: `nats:/127.0.0.1:4222` is not a NATS server address",
        "outroute.toml:routes[0].allow.kafka: pattern `orders/*` can never match: Kafka topics have no `/`",
        "outroute.toml:routes[0].allow.nats: pattern `orders.>`: `>` is a NATS wildcard",
        "outroute.toml:routes[0].max_messages_per_event: must be at least 1",
        "outroute.toml:sinks.nats.max_in_flight: must be at least 1",
        "outroute.toml:store.max_connections: must be at least 1",
        "outroute.toml:http.listen: `:99999` is not host:port",
        "outroute.toml:sinks.nats.create_stream.subjects: `orders..x` is not a NATS subject",
    ] {
        assert!(text.contains(expected), "{expected}\n---\n{text}");
    }
    // Glob syntax in a Kafka pattern is not a bad character.
    assert!(!text.contains("orders.{a,b}-?"), "{text}");
    // Directives and plain levels stay accepted.
    assert_eq!(
        super::validate::check_log_level("info,outroute::plugin=debug"),
        Ok(())
    );
    assert_eq!(super::validate::check_log_level("WARN"), Ok(()));
    assert_eq!(
        super::validate::check_nats_url("nats://a:4222, tls://b:4223,c:4222"),
        Ok(())
    );
}

#[test]
fn type_errors_name_the_key() {
    let d = tmp();
    let body = GOOD.replace("[store]", "[relay]\nbatch_size = \"many\"\n[store]");
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(text.contains("outroute.toml:relay.batch_size:"), "{text}");
}

#[test]
fn unknown_keys_are_refused() {
    let d = tmp();
    let body = GOOD.replace("[store]", "[store]\nurll = \"x\"");
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(text.contains("urll"), "{text}");
}

#[test]
fn injection_through_identifiers_is_refused() {
    let d = tmp();
    let body = GOOD.replace(
        "[sinks.kafka]",
        "[store.table]\nname = \"outbox; drop table x\"\nid = \"id\"\naggregate_id = \"a\"\nevent_type = \"e\"\npayload = \"p\"\ncreated_at = \"c\"\n[sinks.kafka]",
    );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(text.contains("store.table.name"), "{text}");
    assert!(check_identifier("app.outbox", true).is_ok());
    assert!(check_identifier("a\"b", false).is_err());
    assert!(check_identifier("1abc", false).is_err());
}

#[test]
fn the_queue_needs_a_failed_marker() {
    let d = tmp();
    let table = "[store.table]\nname = \"ev\"\nid = \"id\"\nsequence = \"seq\"\naggregate_id = \"a\"\n\
        aggregate_type_value = \"order\"\nevent_type = \"e\"\npayload = \"p\"\ncreated_at = \"c\"\n\
        marking = { style = \"queue\" }\n";
    let body = GOOD.replace("[sinks.kafka]", &format!("{table}[sinks.kafka]"));
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(
        text.contains("store.table.failed_at") && text.contains("count as published"),
        "{text}"
    );
    let body = GOOD.replace(
        "[sinks.kafka]",
        &format!("{table}failed_at = \"f\"\n[sinks.kafka]"),
    );
    assert!(load(&write(&d, &body)).is_ok());
}

#[test]
fn redacts_passwords() {
    assert_eq!(
        redact_url("postgres://u:secret@h/db"),
        "postgres://u:****@h/db"
    );
    assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
    assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    // A NATS token is a userinfo without `:`.
    assert_eq!(redact_url("nats://s3cr3t@h:4222"), "nats://****@h:4222");
    assert_eq!(redact_url("tls://u:p@h"), "tls://u:****@h");
    // An `@` in the path is not a userinfo; in the password it is.
    assert_eq!(redact_url("nats://h/a@b"), "nats://h/a@b");
    assert_eq!(
        redact_url("postgres://u:p@ss@h/db"),
        "postgres://u:****@h/db"
    );
    assert_eq!(
        redact_url("postgres://h/db?sslmode=require&password=s3cr3t&sslpassword=x#f"),
        "postgres://h/db?sslmode=require&password=****&sslpassword=****#f"
    );
    assert_eq!(
        redact_url("postgresql://u@h/db?application_name=a&Token=t"),
        "postgresql://u@h/db?application_name=a&Token=****"
    );
    assert_eq!(redact_url("not a url"), "not a url");
    // A client library's message naming the URL or its secret.
    assert_eq!(
        scrub(
            "cannot connect to nats://s3cr3t@h:4222 (token s3cr3t refused)",
            "nats://s3cr3t@h:4222"
        ),
        "cannot connect to nats://****@h:4222 (token **** refused)"
    );
    assert_eq!(
        scrub(
            "auth failed for p4ss",
            "postgres://u:p4ss@h/db?password=p4ss"
        ),
        "auth failed for ****"
    );
}

/// `relay.max_connections` is split equally among the PostgreSQL sources
/// (less each one's LISTEN connection, never above a source's own
/// `max_connections`); one too low to give each source three is refused.
#[test]
fn the_relay_wide_connection_ceiling_is_shared_and_checked() {
    let d = tmp();
    std::fs::create_dir_all(d.join("teams")).unwrap();
    let body = PLATFORM.replacen(
        "[sources.orders]",
        "[relay]\nmax_connections = 5\n[sources.orders]",
        1,
    );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(
        text.contains(
            "outroute.toml:relay.max_connections: 5 is under 3 per PostgreSQL or MySQL source (2 of them"
        ),
        "{text}"
    );
    let shared = load(&write(
        &d,
        &body.replace("max_connections = 5", "max_connections = 12"),
    ))
    .unwrap()
    .config;
    for sc in shared.sources.values() {
        assert_eq!(
            sc.pool_size(&shared.relay, 2),
            5,
            "12 / 2 sources, less LISTEN"
        );
    }
    let roomy = load(&write(
        &d,
        &body.replace("max_connections = 5", "max_connections = 100"),
    ))
    .unwrap()
    .config;
    for sc in roomy.sources.values() {
        assert_eq!(
            sc.pool_size(&roomy.relay, 2),
            8,
            "a source's own max_connections"
        );
    }
    let unset = load(&write(&d, PLATFORM)).unwrap().config;
    for sc in unset.sources.values() {
        assert_eq!(sc.pool_size(&unset.relay, 2), 8);
    }
}

#[test]
fn owners_and_dead_letters_are_the_teams_own() {
    let d = tmp();
    let f = write(&d, PLATFORM);
    let team = d.join("teams/payments.toml").display().to_string();
    // A team route is owned by its team, whatever it leaves out; it may
    // say how to reach it, and send dead letters where its grant allows.
    team_file(
        &d,
        "payments.toml",
        &format!(
            "{PAYMENTS}owner_contact = \"#payments-oncall\"\n\
             dead_letter = {{ sink = \"kafka\", topic = \"payments.dead\" }}\n"
        ),
    );
    let l = load(&f).unwrap();
    assert!(l.refused.is_empty(), "{:?}", l.refused);
    let r = &l.config.routes[0];
    assert_eq!(r.owner(), "payments");
    assert_eq!(r.owner_contact.as_deref(), Some("#payments-oncall"));
    assert_eq!(
        r.dead_letter.as_ref().map(|d| d.topic.as_str()),
        Some("payments.dead")
    );
    // A file cannot name another owner (the self-declared team name), nor
    // send its dead letters to another team's topic.
    team_file(
        &d,
        "payments.toml",
        &format!(
            "{PAYMENTS}owner = \"billing\"\n\
             dead_letter = {{ sink = \"kafka\", topic = \"billing.dead\" }}\n"
        ),
    );
    let p = problems(&f);
    for (key, needle) in [
        ("routes[0].owner", "owner `billing` is not team `payments`"),
        (
            "routes[0].dead_letter",
            "`billing.dead` on sink `kafka` is outside team `payments`'s grant (payments.*)",
        ),
    ] {
        assert!(
            p.iter()
                .any(|e| e.file == team && e.key == key && e.reason.contains(needle)),
            "{key}: {p:?}"
        );
    }
    // A main-file route is the platform's unless it names an owner.
    let l = load(&write(&d, GOOD)).unwrap();
    assert_eq!(l.config.routes[0].owner(), "platform");
    let named = GOOD.replace(
        "plugin = \"p\"\n",
        "plugin = \"p\"\nowner = \"orders-team\"\n",
    );
    assert_eq!(
        load(&write(&d, &named)).unwrap().config.routes[0].owner(),
        "orders-team"
    );
}

#[test]
fn bad_owners_and_dead_letters_are_named() {
    let d = tmp();
    let body = GOOD.replace(
        "plugin = \"p\"\n",
        "plugin = \"p\"\nowner = \" \"\nowner_contact = \"a\\nb\"\n\
         dead_letter = { sink = \"kafka\", topic = \"orders.*\" }\n",
    );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    for expected in [
        "outroute.toml:routes[0].owner: owner \" \" must be one line of 1–128 characters",
        "outroute.toml:routes[0].owner_contact: must be one line of at most 256 characters",
        "outroute.toml:routes[0].dead_letter.topic: `orders.*` is not a topic/subject name",
    ] {
        assert!(text.contains(expected), "{expected}\n---\n{text}");
    }
    let body = GOOD.replace(
        "plugin = \"p\"\n",
        "plugin = \"p\"\ndead_letter = { sink = \"nowhere\", topic = \"orders/dead\" }\n",
    );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(
        text.contains("routes[0].dead_letter.sink: no sink named `nowhere` in [sinks]"),
        "{text}"
    );
    let body = GOOD.replace(
        "plugin = \"p\"\n",
        "plugin = \"p\"\ndead_letter = { sink = \"kafka\", topic = \"orders/dead\" }\n",
    );
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(
        text.contains("routes[0].dead_letter.topic: pattern `orders/dead` can never match: Kafka topics have no `/`"),
        "{text}"
    );
}

#[test]
fn a_console_that_nobody_could_use_safely_is_refused() {
    let d = tmp();
    let console = "[http.console]\nsession_ttl = \"5s\"\n\
         [http.console.tokens.ops]\nrole = \"operator\"\ntoken = \"short\"\n\
         [http.console.tokens.dup]\nrole = \"viewer\"\ntoken = \"same-token-0123456789\"\n\
         [http.console.tokens.dup2]\nrole = \"viewer\"\ntoken = \"same-token-0123456789\"\n\
         [http.console.tokens.team]\nrole = \"operator\"\nteam = \"-\"\ntoken = \"team-token-0123456789\"\n\
         [http.console.tokens.none]\nrole = \"viewer\"\n";
    let body = GOOD.replace("[store]", &format!("{console}[store]"));
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    for expected in [
        "outroute.toml:http.console.session_ttl: must be at least 1m",
        "outroute.toml:http.console.tokens.ops.token: is shorter than 16 characters",
        "outroute.toml:http.console.tokens.dup2.token: is the same as tokens.dup's",
        "outroute.toml:http.console.tokens.team.team: is not a team name",
        "outroute.toml:http.console.tokens.none.token: is not set",
    ] {
        assert!(text.contains(expected), "{expected}\n---\n{text}");
    }
    // The refusal never prints a token.
    assert!(
        !text.contains("same-token-0123456789") && !text.contains("short\""),
        "{text}"
    );
    // No token at all: nobody could sign in.
    let body = GOOD.replace("[store]", "[http.console]\n[store]");
    let text = load(&write(&d, &body)).unwrap_err().to_string();
    assert!(
        text.contains("http.console.tokens: names no token"),
        "{text}"
    );
    // A good one loads, its token from a file.
    std::fs::write(d.join("tok"), "file-token-0123456789\n").unwrap_or_default();
    let body = GOOD.replace(
        "[store]",
        "[http.console.tokens.ops]\nrole = \"operator\"\nteam = \"payments\"\ntoken_file = \"tok\"\n[store]",
    );
    let loaded = load(&write(&d, &body));
    let token = loaded
        .as_ref()
        .ok()
        .and_then(|l| l.config.http.console.as_ref())
        .and_then(|c| c.tokens.get("ops"))
        .and_then(|t| t.token.as_ref())
        .map(|t| t.expose().to_string());
    assert_eq!(
        token.as_deref(),
        Some("file-token-0123456789"),
        "{:?}",
        loaded.err()
    );
}
