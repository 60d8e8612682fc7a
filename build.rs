//! Build script: the man pages and shell completions, generated from the same
//! clap definitions the binary parses with (`src/cli.rs`, included below), so
//! they cannot drift from the real command line.
//!
//! They are written to `OUT_DIR` and copied to `<target>/<profile>/dormant-assets/`:
//! cargo-deb finds files only through `target/release/...` paths, which it maps
//! to the profile directory, while `OUT_DIR` carries a hash that changes with
//! features and versions (several of them can sit side by side). Man pages are
//! gzipped there (Debian policy; cargo-deb compresses only files it did not see
//! built), without a timestamp so the package is reproducible.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

#[path = "src/cli.rs"]
#[allow(dead_code)]
mod cli;

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed=src/cli.rs");
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let assets = out.join("dormant-assets");
    generate(&assets)?;
    // OUT_DIR is <target>/<profile>/build/dormant-<hash>/out.
    if let Some(profile_dir) = out.ancestors().nth(3) {
        copy_tree(&assets, &profile_dir.join("dormant-assets"))?;
    }
    Ok(())
}

fn generate(dir: &Path) -> std::io::Result<()> {
    let man = dir.join("man");
    let completions = dir.join("completions");
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(&completions)?;
    // One page for `dormant` and one per subcommand (`dormant-prepare.1`, ...).
    clap_mangen::generate_to(cli::Cli::command(), &man)?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cli::Cli::command(), "dormant", &completions)?;
    }
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &dest)?;
        } else if dest.extension().is_some_and(|e| e == "1") {
            let mut gz = dest.into_os_string();
            gz.push(".gz");
            let file = std::fs::File::create(gz)?;
            let mut enc = flate2::GzBuilder::new()
                .mtime(0)
                .write(file, flate2::Compression::best());
            std::io::copy(&mut std::fs::File::open(entry.path())?, &mut enc)?;
            enc.finish()?;
        } else {
            std::fs::copy(entry.path(), dest)?;
        }
    }
    Ok(())
}
