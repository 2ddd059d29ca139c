//! `meshd token`: a fresh random token, printed or written to a private file.

use anyhow::{Context, Result, bail};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Write the token to this file (created with mode 0600; an existing file is kept).
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
}

/// 128 random bits from the system's secure source, as 32 hex characters.
pub fn fresh() -> Result<String> {
    let mut b = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .map_err(|_| anyhow::anyhow!("the system's random source failed"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

pub fn main(a: Args) -> Result<ExitCode> {
    let token = fresh()?;
    let Some(path) = a.file else {
        println!("{token}");
        return Ok(ExitCode::SUCCESS);
    };
    let mut f = match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            bail!("{} already exists: not overwritten (remove it first to make a new token)", path.display())
        }
        Err(e) => return Err(e).with_context(|| format!("cannot create {}", path.display())),
    };
    writeln!(f, "{token}").with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "wrote a new token to {} (mode 0600): copy it to every node and pass --token-file {}",
        path.display(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn tokens_are_fresh_128_bit_hex_and_files_private() {
        let (a, b) = (fresh().expect("a"), fresh().expect("b"));
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        let path = std::env::temp_dir().join(format!("meshd-token-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        main(Args { file: Some(path.clone()) }).expect("write");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(mode, 0o600);
        assert_eq!(text.trim().len(), 32);
        // Never overwritten.
        assert!(main(Args { file: Some(path.clone()) }).is_err());
        assert_eq!(std::fs::read_to_string(&path).expect("read"), text);
        let _ = std::fs::remove_file(&path);
    }
}
