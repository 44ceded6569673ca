//! `peercomm-signal-bindings HEADER OUTPUT`: writes bindgen's Rust mirror of the signal
//! layout header, with the options the committed `src/signal_bindings.rs` was made with.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [header, output] = args.as_slice() else {
        eprintln!("usage: peercomm-signal-bindings HEADER OUTPUT");
        return ExitCode::from(2);
    };
    let bindings = match bindgen::Builder::default()
        .header(header)
        .allowlist_type("peercomm_.*")
        .allowlist_var("PEERCOMM_.*")
        // src/signal.rs checks the layout (offsets and sizes) in its own tests.
        .layout_tests(false)
        .derive_default(true)
        .derive_debug(true)
        .derive_copy(true)
        .prepend_enum_name(false)
        .rustified_enum("peercomm_dtype")
        .generate()
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!("bindgen failed on {header}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = bindings.write_to_file(output) {
        eprintln!("write {output}: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
