//! Records where NCCL was at build time, as one more place to look at run time.
//!
//! Nothing is linked and the build never fails: when neither NCCL_HOME nor CUDA_HOME holds a
//! libnccl, the hint is simply empty.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=NCCL_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let hint = ["NCCL_HOME", "CUDA_HOME"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .flat_map(|home| {
            [
                "lib/libnccl.so.2",
                "lib64/libnccl.so.2",
                "lib/x86_64-linux-gnu/libnccl.so.2",
            ]
            .map(|rel| home.join(rel))
        })
        .find(|path| path.is_file())
        .map(|path| path.display().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=NCCL_RS_BUILD_HINT={hint}");
}
