//! libmpsr_state.so carries a SONAME (libmpsr_state.so.0): programs linked with -lmpsr_state
//! record it, so an incompatible library can ship beside it as .so.1 one day.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmpsr_state.so.0");
    // Both symbol hash tables, as distributions link their libraries (older loaders read .hash).
    println!("cargo:rustc-cdylib-link-arg=-Wl,--hash-style=both");
}
