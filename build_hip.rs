//! HIP device-code build (feature `hip`). Placeholder until the HIP backend lands.
use std::path::Path;

pub fn build(_out_dir: &Path) {
    panic!("feature `hip` is not implemented yet");
}
