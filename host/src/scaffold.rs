//! `outroute plugin new NAME --lang rust|python|js`: start a plugin project
//! that builds and tests as it is — a router with a config, a unit test
//! (Rust) or a test through the relay's own sandbox (Python, TypeScript), a
//! sample event file and the commands to build, test and try it. The
//! templates are in `host/templates/`; the Python and TypeScript projects
//! carry a copy of the WIT contract.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The languages a plugin project can be started in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    /// TypeScript, built with tsc and componentize-js (npm).
    Js,
}

const RUST_CARGO: &str = include_str!("../templates/rust/Cargo.toml.tmpl");
const RUST_LIB: &str = include_str!("../templates/rust/src/lib.rs");
const SAMPLE: &str = include_str!("../templates/sample-event.json");
const PY_APP: &str = include_str!("../templates/python/app.py");
const PY_BUILD: &str = include_str!("../templates/python/build.sh");
const SANDBOX_TEST: &str = include_str!("../templates/test.sh");
const JS_PACKAGE: &str = include_str!("../templates/js/package.json.tmpl");
const JS_TSCONFIG: &str = include_str!("../templates/js/tsconfig.json");
const JS_ROUTER: &str = include_str!("../templates/js/src/router.ts");
const JS_WORLD: &str = include_str!("../../plugins/js-router/src/world.d.ts");
const JS_BUILD: &str = include_str!("../templates/js/build.sh");
const WIT: &str = include_str!("../../wit/router.wit");

/// The guest SDK this relay was built from (a source checkout).
fn default_sdk() -> Option<PathBuf> {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../guest-sdk"))
        .canonicalize()
        .ok()
}

/// Create the project; returns its directory and the commands to run next.
pub fn new(
    name: &str,
    lang: Lang,
    dir: Option<PathBuf>,
    sdk: Option<PathBuf>,
) -> Result<(PathBuf, Vec<String>)> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        || !name.starts_with(|c: char| c.is_ascii_lowercase())
    {
        bail!(
            "plugin name `{name}`: use lowercase letters, digits and `-`, starting with a letter"
        );
    }
    let dir = dir.unwrap_or_else(|| PathBuf::from(name));
    if dir.exists()
        && std::fs::read_dir(&dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        bail!(
            "{} exists and is not empty: pick another --dir",
            dir.display()
        );
    }
    let krate = name.replace('-', "_");
    let fill = |t: &str, sdk: &str| {
        t.replace("{{name}}", name)
            .replace("{{crate}}", &krate)
            .replace("{{sdk}}", sdk)
    };
    let write = |rel: &str, body: String| -> Result<()> {
        let p = dir.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&p, body).with_context(|| format!("writing {}", p.display()))
    };
    let next = match lang {
        Lang::Rust => {
            let sdk = match sdk.or_else(default_sdk) {
                Some(s) => s,
                None => bail!(
                    "the outroute-guest SDK was not found next to this build: pass --sdk <path to guest-sdk>"
                ),
            };
            let sdk = sdk
                .canonicalize()
                .with_context(|| format!("--sdk {}", sdk.display()))?;
            if !sdk.join("Cargo.toml").is_file() {
                bail!(
                    "--sdk {}: no Cargo.toml there (the outroute-guest crate)",
                    sdk.display()
                );
            }
            let sdk = sdk.display().to_string().replace('\\', "/");
            write("Cargo.toml", fill(RUST_CARGO, &sdk))?;
            write("src/lib.rs", fill(RUST_LIB, &sdk))?;
            write("sample-event.json", SAMPLE.to_string())?;
            vec![
                "cargo test".to_string(),
                "rustup target add wasm32-wasip2   # once".to_string(),
                "cargo build --release --target wasm32-wasip2".to_string(),
                format!(
                    "outroute plugin test target/wasm32-wasip2/release/{krate}.wasm --event sample-event.json"
                ),
            ]
        }
        Lang::Python => {
            write("app.py", fill(PY_APP, ""))?;
            write("build.sh", fill(PY_BUILD, ""))?;
            write("test.sh", fill(SANDBOX_TEST, ""))?;
            write("wit/router.wit", WIT.to_string())?;
            write("sample-event.json", SAMPLE.to_string())?;
            executable(&dir, &["build.sh", "test.sh"])?;
            vec![
                "./test.sh".to_string(),
                format!("./build.sh   # → {krate}.wasm"),
            ]
        }
        Lang::Js => {
            write("package.json", fill(JS_PACKAGE, ""))?;
            write("tsconfig.json", JS_TSCONFIG.to_string())?;
            write("src/router.ts", fill(JS_ROUTER, ""))?;
            write("src/world.d.ts", JS_WORLD.to_string())?;
            write("build.sh", fill(JS_BUILD, ""))?;
            write("test.sh", fill(SANDBOX_TEST, ""))?;
            write("wit/router.wit", WIT.to_string())?;
            write("sample-event.json", SAMPLE.to_string())?;
            write(".gitignore", "node_modules/\ndist/\n*.wasm\n".to_string())?;
            executable(&dir, &["build.sh", "test.sh"])?;
            vec![
                "./test.sh   # npm install on first run".to_string(),
                format!("./build.sh   # → {krate}.wasm"),
            ]
        }
    };
    Ok((dir, next))
}

/// Make the project's scripts executable.
fn executable(dir: &Path, files: &[&str]) -> Result<()> {
    #[cfg(unix)]
    for f in files {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o755))?;
    }
    #[cfg(not(unix))]
    let _ = (dir, files);
    Ok(())
}
