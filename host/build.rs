//! Embeds the demo routing plugin (order-router) in the binary when it has
//! been built (`scripts/build-plugins`), so `outroute quickstart` runs from
//! any directory. Without it the binary still builds; the quickstart then
//! asks for `--plugin`.
fn main() {
    let demo =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/dist/order_router.wasm");
    println!("cargo:rustc-check-cfg=cfg(embedded_demo)");
    println!("cargo:rerun-if-changed={}", demo.display());
    if demo.is_file() {
        println!("cargo:rustc-cfg=embedded_demo");
        println!("cargo:rustc-env=OUTROUTE_DEMO_PLUGIN={}", demo.display());
    }
}
