//! `outroute plugin inspect`: what a file is (a component or not), the
//! world it exports, what it imports, the contract it was built against,
//! and its name and version — without routing anything.

use super::*;

/// What `outroute plugin inspect` shows.
#[derive(Debug, serde::Serialize)]
pub struct Inspection {
    pub file: String,
    pub sha256: String,
    pub world: &'static str,
    /// The contract the plugin was built against (from its imports).
    pub contract: String,
    /// The contract this relay speaks.
    pub host_contract: &'static str,
    pub name: String,
    pub version: String,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

/// Read a component's imports/exports and its self-description.
pub fn inspect(runtime: &Runtime, path: &Path) -> Result<Inspection> {
    let compiled = runtime.compile(path)?;
    let ty = compiled.code.component.component_type();
    let engine = &runtime.engine;
    let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
    let exports = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let hash = compiled.hash.clone();
    let limits = Limits {
        cpu_budget: Duration::from_secs(1),
        memory_bytes: 256 << 20,
        log_lines_per_event: 100,
        log_bytes_per_event: 64 << 10,
        max_idle_bytes: 0,
    };
    let mut store = runtime.new_store("inspect", limits.caps());
    let deadline = store.data_mut().begin_call(limits.cpu_budget, 1);
    store.set_epoch_deadline(deadline);
    let router = compiled.code.pre.instantiate(&mut store)?;
    let info = router.call_describe(&mut store).map_err(|e| {
        anyhow!(
            "describe failed: {}",
            trap_reason(&e, &store, limits, "for describe")
        )
    })?;
    Ok(Inspection {
        file: path.display().to_string(),
        sha256: hash,
        world: "outroute:router/router",
        contract: contract_of(&imports)
            .unwrap_or_else(|| "none (imports no outroute interface)".into()),
        host_contract: CONTRACT,
        name: info.name,
        version: info.version,
        imports,
        exports,
    })
}

/// Why a file plainly is no component, from its first bytes (a clearer
/// reason than the parser's); `None` leaves the judgement to the parser.
pub(super) fn not_a_component(bytes: &[u8]) -> Option<&'static str> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Some(
            "is not a WebAssembly file (it does not start with the `\\0asm` header): \
             give the `.wasm` a plugin build wrote (target wasm32-wasip2)",
        );
    }
    // Bytes 6-7: the layer, 0 for a core module, 1 for a component.
    if bytes[6..8] == [0, 0] {
        return Some(
            "is a core WebAssembly module, not a component: build the plugin for the \
             wasm32-wasip2 target (or wrap the module with `wasm-tools component new`)",
        );
    }
    None
}
