//! The `outroute` command line; see the library docs (`lib.rs`) for the map.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use outroute::ops::ConfigArg;
use outroute::{config, ops, quickstart};

/// mimalloc rather than glibc's malloc: allocation was a quarter of the
/// relay's CPU per event (docs/src/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "outroute",
    version,
    about = "Transactional-outbox relay with WebAssembly routing plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Relay events until SIGTERM/SIGINT; SIGHUP reloads the config.
    Run(ConfigArg),
    /// Create outroute's tables (and the canonical outbox table). Idempotent.
    Migrate {
        #[command(flatten)]
        config: ConfigArg,
        /// Only the coordination tables, not the canonical outbox table.
        #[arg(long)]
        coordination_only: bool,
        /// Also add what the fast claim needs to the configured (existing)
        /// table: its lane index, built CONCURRENTLY (producers keep
        /// writing), or under `marking = queue` the pending queue's trigger
        /// and the rows already pending.
        #[arg(long)]
        table: bool,
        /// With --table, for a table without a sequence column: add one
        /// (`outroute_seq`, an identity column) so events written in one
        /// transaction have a defined order. Rewrites the table under an
        /// ACCESS EXCLUSIVE lock: producers wait for the whole rewrite.
        #[arg(long, requires = "table")]
        add_sequence: bool,
    },
    /// Backlog, oldest pending age, failed count, relays and their lanes.
    Status {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// Failed events (outroute's dead-letter state): list, show, edit, retry, discard.
    Failed {
        #[command(subcommand)]
        action: ops::FailedAction,
    },
    /// Routes: list them with their quarantine state; resume a quarantined one.
    Route {
        #[command(subcommand)]
        action: ops::RouteAction,
    },
    /// Replication slots of `capture = "logical"` sources.
    Slot {
        #[command(subcommand)]
        action: ops::SlotAction,
    },
    /// Re-publish already-published events.
    Replay(ops::ReplayArgs),
    /// Compare what the outbox published in a window with what the
    /// brokers hold: missing, duplicated, out-of-order and unexpected
    /// messages; exits 1 on any missing or out of order.
    Reconcile(ops::ReconcileArgs),
    /// Plugins: scaffold, test, inspect, try on recorded events, shadow report, promote.
    Plugin {
        #[command(subcommand)]
        action: ops::PluginAction,
    },
    /// Check a configuration file or print its JSON Schema.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Run the embedded demo end to end: SQLite outbox, example plugin, file sink.
    Quickstart(quickstart::QuickstartArgs),
    /// Print a reference page of the user guide (Markdown), generated from
    /// the code: `docs/src/reference/<PAGE>.md`.
    Reference {
        #[arg(value_enum)]
        page: ReferencePage,
    },
}

/// The generated pages of the user guide's reference.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ReferencePage {
    /// Every configuration key (from the config's JSON Schema).
    Config,
    /// Every command and option (from this command line's definitions).
    Cli,
    /// Every Prometheus series with its kind, labels and meaning.
    Metrics,
}

/// The reference page `page`.
fn reference(page: ReferencePage) -> String {
    match page {
        ReferencePage::Config => config::reference_markdown(),
        ReferencePage::Cli => {
            let options = clap_markdown::MarkdownOptions::new()
                .title("Command-line reference".to_string())
                .show_footer(false)
                .show_table_of_contents(true);
            clap_markdown::help_markdown_custom::<Cli>(&options)
        }
        ReferencePage::Metrics => outroute::metrics::reference_markdown(),
    }
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Validate a file; prints `file:key: reason` for every problem. Also
    /// loads every route's plugin as `run` does (compiled, `init` with the
    /// route's config).
    Check {
        #[command(flatten)]
        config: ConfigArg,
        /// Also connect to the store: check the table, its columns and the
        /// lane index the claim needs (printing the CREATE INDEX if missing).
        #[arg(long)]
        store: bool,
        /// Also reach every sink as `run` would, publishing and creating
        /// nothing: Kafka brokers answer, the NATS server takes the
        /// credentials and a JetStream stream captures every subject the
        /// routes allow. A broker that is down fails the check.
        #[arg(long)]
        sinks: bool,
    },
    /// What a reload from OLD to NEW would change: sources, sinks, plugins
    /// and routes added, removed or changed, and settings that need a restart.
    Diff {
        old: std::path::PathBuf,
        new: std::path::PathBuf,
    },
    /// Print the JSON Schema of the configuration file (for editors).
    Schema,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    quiet_on_closed_pipe(&cli.command);
    outroute::tls_provider();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outroute: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outroute: {}", ops::describe(&e));
            ExitCode::FAILURE
        }
    }
}

/// A one-shot command piped into `head` ends quietly when the reader goes
/// away, as Unix tools do: Rust ignores SIGPIPE, so `println!` panicked
/// ("failed printing to stdout: Broken pipe"); such commands get its default
/// back. Sockets are not affected: Rust's socket writes (tokio, sqlx,
/// rustls, async-nats) pass `MSG_NOSIGNAL`, and librdkafka's threads block
/// every signal. The relay (`run`, `quickstart`) keeps ignoring it: a log
/// reader that goes away must not stop it.
fn quiet_on_closed_pipe(command: &Command) {
    if !matches!(command, Command::Run(_) | Command::Quickstart(_)) {
        // SAFETY: before any thread exists; sets the signal's default action.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(c) => ops::run(&c).await,
        Command::Migrate {
            config,
            coordination_only,
            table,
            add_sequence,
        } => ops::migrate(&config, !coordination_only, table, add_sequence).await,
        Command::Status { config, json } => ops::status(&config, json).await,
        Command::Failed { action } => ops::failed(action).await,
        Command::Route { action } => ops::route(action).await,
        Command::Slot { action } => ops::slot(action).await,
        Command::Replay(args) => ops::replay(args).await,
        Command::Reconcile(args) => ops::reconcile(args).await,
        Command::Plugin { action } => ops::plugin(action).await,
        Command::Config {
            action:
                ConfigAction::Check {
                    config,
                    store,
                    sinks,
                },
        } => ops::config_check(&config, store, sinks).await,
        Command::Config {
            action: ConfigAction::Diff { old, new },
        } => ops::config_diff(&old, &new),
        Command::Config {
            action: ConfigAction::Schema,
        } => {
            println!("{}", serde_json::to_string_pretty(&config::schema())?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Quickstart(args) => quickstart::run(args).await,
        Command::Reference { page } => {
            print!("{}", reference(page));
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_reference_page_is_fresh() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/src/reference/cli.md");
        let page = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            page == reference(ReferencePage::Cli),
            "docs/src/reference/cli.md is stale: run `outroute reference cli > docs/src/reference/cli.md`"
        );
    }
}
