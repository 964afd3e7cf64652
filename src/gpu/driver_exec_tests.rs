use super::*;
use crate::cdi::fake_root::{native_dir, running_as_root, FakeRoot};

fn env_of<'a>(command: &'a Command, name: &str) -> Option<Option<&'a std::ffi::OsStr>> {
    command
        .get_envs()
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

#[test]
fn a_host_roots_program_runs_inside_the_root_without_this_containers_library_path() {
    if !running_as_root("a_host_roots_program_runs_inside_the_root") {
        return;
    }
    let root = FakeRoot::host_like();
    root.stand_in(
        "/usr/bin/nvidia-smi",
        r#"echo "$@" > /args; echo "$PATH" > /path; echo ok"#,
    );
    let smi = DriverCommand::find(root.path(), "nvidia-smi").unwrap();
    assert!(smi.runs_inside_root());
    assert!(
        smi.describe().ends_with(&format!(
            "chroot {} /usr/bin/nvidia-smi",
            root.path().display()
        )),
        "{}",
        smi.describe()
    );
    let mut command = smi.command();
    assert_eq!(
        env_of(&command, "LD_LIBRARY_PATH"),
        Some(None),
        "removed, not inherited"
    );
    let output = command.args(["-L", "-i", "GPU-1"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "ok");
    let read = |name: &str| std::fs::read_to_string(root.path().join(name)).unwrap();
    assert_eq!(read("args").trim(), "-L -i GPU-1");
    assert!(
        read("path").starts_with("/usr/bin:"),
        "its own directory first, as the root sees it: {}",
        read("path")
    );
}

#[test]
fn the_host_like_stand_in_fails_as_the_real_program_when_started_from_outside() {
    // What the plugin did before: the root's program with the root's library directory on the
    // loader's path. The stand-in refuses as nvidia-smi does on Ubuntu 22.04/24.04 and RHEL 9.
    let root = FakeRoot::host_like();
    root.stand_in("/usr/bin/nvidia-smi", "echo ok");
    let libs = root.path().join(native_dir().trim_start_matches('/'));
    assert!(libs.join("libc.so.6").exists(), "a host's libc is there");
    let output = Command::new(root.path().join("usr/bin/nvidia-smi"))
        .env("LD_LIBRARY_PATH", &libs)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(127), "{output:?}");
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("version `GLIBC_PRIVATE' not found"), "{said}");
    // Without the root's libraries the real one cannot find libnvidia-ml.
    let output = Command::new(root.path().join("usr/bin/nvidia-smi"))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stdout).contains("couldn't find libnvidia-ml.so"));
}

#[test]
fn a_root_without_a_loader_runs_its_program_from_outside_with_its_libraries() {
    let root = FakeRoot::programs_only();
    root.stand_in("/bin/nvidia-smi", r#"echo "$@""#);
    let smi = DriverCommand::find(root.path(), "nvidia-smi").unwrap();
    assert!(!smi.runs_inside_root());
    let binary = root.path().join("bin/nvidia-smi");
    assert_eq!(smi.describe(), binary.display().to_string());
    let mut command = smi.command();
    let libs = root.path().join("lib64");
    let path = env_of(&command, "LD_LIBRARY_PATH").flatten().unwrap();
    assert_eq!(
        path.to_string_lossy().split(':').next(),
        Some(libs.to_str().unwrap())
    );
    let output = command.arg("-L").output().unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "-L");
    // It sees this container's paths.
    assert_eq!(
        smi.path_seen_by_program(Path::new("/var/lib/x")),
        Some(PathBuf::from("/var/lib/x"))
    );
}

#[test]
fn a_root_that_cannot_run_its_program_is_refused_where_its_libc_would_be_loaded() {
    let root = FakeRoot::programs_only();
    root.stand_in("/bin/nvidia-smi", "echo ok")
        .lib("/lib64/libc.so.6");
    let err = DriverCommand::find(root.path(), "nvidia-smi").unwrap_err();
    assert!(
        matches!(err, DriverExecError::WouldLoadRootLibc { .. }),
        "{err}"
    );
    let text = err.to_string();
    for part in [
        format!(
            "{} cannot be run",
            root.path().join("bin/nvidia-smi").display()
        ),
        format!("the driver root {} has no /bin/sh", root.path().display()),
        format!(
            "would load the root's {}",
            root.path().join("lib64/libc.so.6").display()
        ),
        "GLIBC_PRIVATE".to_string(),
    ] {
        assert!(text.contains(&part), "{part:?} in {text}");
    }
    // Set up at start, it keeps the reason for every message about it.
    let kept = DriverCommand::refused(root.path(), "nvidia-smi", &err);
    assert_eq!(kept.describe(), text);
    assert!(
        kept.runs_inside_root(),
        "never started with the root's libc"
    );
}

#[test]
fn paths_below_the_root_are_seen_from_inside_it() {
    if !running_as_root("paths_below_the_root_are_seen_from_inside_it") {
        return;
    }
    let root = FakeRoot::host_like();
    root.stand_in("/usr/bin/nvidia-cuda-mps-control", "exit 0");
    let control = DriverCommand::find(root.path(), "nvidia-cuda-mps-control").unwrap();
    assert_eq!(
        control.path_seen_by_program(&root.path().join("tmp/nvidia-mps")),
        Some(PathBuf::from("/tmp/nvidia-mps"))
    );
    assert_eq!(
        control.path_seen_by_program(Path::new("/var/lib/kubelet/plugins/x")),
        None
    );
}

#[test]
fn the_root_slash_runs_its_programs_as_they_are() {
    let sh = DriverCommand::find(Path::new("/"), "sh").unwrap();
    assert!(sh.runs_inside_root());
    assert!(sh.describe().starts_with('/'), "{}", sh.describe());
    assert!(!sh.describe().contains("chroot"), "{}", sh.describe());
    let output = sh.command().args(["-c", "echo ok"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "ok");
}

#[test]
fn a_missing_or_unreadable_program_names_the_root_and_what_is_wrong() {
    let root = FakeRoot::new();
    let err = DriverCommand::find(root.path(), "nvidia-smi")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "nvidia-smi not found under the driver root {} (looked in /usr/bin, /usr/local/bin",
            root.path().display()
        )),
        "{err}"
    );
    root.bin("/usr/bin/nvidia-smi");
    let err = DriverCommand::find(root.path(), "nvidia-smi")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot be run: not a readable ELF file"),
        "{err}"
    );
    root.write("/usr/bin/nvidia-smi", b"MZ\x90\x00", 0o755);
    let err = DriverCommand::find(root.path(), "nvidia-smi")
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("neither an ELF program nor a #! script"),
        "{err}"
    );
}

/// An ELF header with one program header: `PT_INTERP` naming `loader`, or a `PT_LOAD` when `None`.
fn elf(wide: bool, little: bool, loader: Option<&str>) -> Vec<u8> {
    let put = |out: &mut Vec<u8>, at: usize, size: usize, value: u64| {
        if out.len() < at + size {
            out.resize(at + size, 0);
        }
        for i in 0..size {
            let byte = (value >> (8 * i)) as u8;
            let index = if little { at + i } else { at + size - 1 - i };
            out[index] = byte;
        }
    };
    let mut out = b"\x7fELF".to_vec();
    out.extend([if wide { 2 } else { 1 }, if little { 1 } else { 2 }, 1]);
    let (header, entry) = if wide { (64, 56) } else { (52, 32) };
    let text = header + entry;
    if wide {
        put(&mut out, 0x20, 8, header as u64);
        put(&mut out, 0x36, 2, entry as u64);
        put(&mut out, 0x38, 2, 1);
    } else {
        put(&mut out, 0x1c, 4, header as u64);
        put(&mut out, 0x2a, 2, entry as u64);
        put(&mut out, 0x2c, 2, 1);
    }
    let kind = if loader.is_some() { PT_INTERP } else { 1 };
    let name = loader.map(|l| format!("{l}\0")).unwrap_or_default();
    put(&mut out, header, 4, u64::from(kind));
    let (offset_at, size_at, word) = if wide { (8, 32, 8) } else { (4, 16, 4) };
    put(&mut out, header + offset_at, word, text as u64);
    put(&mut out, header + size_at, word, name.len() as u64);
    out.resize(text, 0);
    out.extend(name.as_bytes());
    out
}

#[test]
fn the_loader_is_read_from_elf_programs_of_either_class_and_byte_order() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("program");
    for wide in [true, false] {
        for little in [true, false] {
            std::fs::write(&file, elf(wide, little, Some("/lib/ld-linux-aarch64.so.1"))).unwrap();
            assert_eq!(
                interpreter_of(&file),
                Ok(Some(PathBuf::from("/lib/ld-linux-aarch64.so.1"))),
                "wide {wide}, little {little}"
            );
            std::fs::write(&file, elf(wide, little, None)).unwrap();
            assert_eq!(interpreter_of(&file), Ok(None), "static: wide {wide}");
        }
    }
    // This machine's shell names the loader ldd names.
    let loader = interpreter_of(Path::new("/bin/sh")).unwrap().unwrap();
    let ldd = Command::new("ldd").arg("/bin/sh").output().unwrap();
    assert!(
        String::from_utf8_lossy(&ldd.stdout).contains(loader.to_str().unwrap()),
        "{loader:?}"
    );
    // A header that points past the file's end is an error, not a panic.
    let mut broken = elf(true, true, Some("/lib64/ld.so"));
    broken.truncate(70);
    std::fs::write(&file, broken).unwrap();
    assert!(interpreter_of(&file).is_err());
}

#[test]
fn a_static_program_runs_inside_a_root_that_has_nothing_else() {
    let root = FakeRoot::programs_only();
    root.write("/bin/nvidia-smi", &elf(true, true, None), 0o755);
    let smi = DriverCommand::find(root.path(), "nvidia-smi").unwrap();
    assert!(smi.runs_inside_root(), "{}", smi.describe());
    // A script whose interpreter is there runs inside too; one whose interpreter is missing does not.
    root.write("/bin/sh", &elf(true, true, None), 0o755)
        .stand_in("/usr/bin/nvidia-cuda-mps-control", "exit 0");
    assert!(DriverCommand::find(root.path(), "nvidia-cuda-mps-control")
        .unwrap()
        .runs_inside_root());
    root.write("/usr/bin/nvidia-debugdump", b"#!/usr/bin/python3\n", 0o755);
    assert!(!DriverCommand::find(root.path(), "nvidia-debugdump")
        .unwrap()
        .runs_inside_root());
}
