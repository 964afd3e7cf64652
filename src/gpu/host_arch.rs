//! The CPU architecture of a GPU host as its driver files show it. The plugin serves the host it runs on, so
//! it looks only at that architecture's libraries: another architecture's libnvidia-ml cannot be loaded and
//! its libcuda is of no use to the containers. A parameter, not only a `cfg!`, so that an AArch64 host's
//! layout (Grace: GH200, GB200) is tested on any machine.

/// A host's architecture: the Debian multiarch triple of its library directories, and the flags ldconfig
/// gives its 64-bit libraries in `/etc/ld.so.cache`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostArch {
    pub multiarch: &'static str,
    /// `FLAG_ELF_LIBC6` (the low byte) plus the architecture's 64-bit ABI byte (`FLAG_X8664_LIB64`,
    /// `FLAG_AARCH64_LIB64`), as glibc's ldconfig writes them.
    pub ld_cache_flags: i32,
}

impl HostArch {
    pub const X86_64: Self = Self {
        multiarch: "x86_64-linux-gnu",
        ld_cache_flags: 0x0303,
    };
    /// Grace hosts: `/usr/lib/aarch64-linux-gnu` on Debian and Ubuntu.
    pub const AARCH64: Self = Self {
        multiarch: "aarch64-linux-gnu",
        ld_cache_flags: 0x0a03,
    };
    /// This process's architecture; `None` on others, where only the directories without a triple are
    /// searched and the ld.so.cache is not read.
    pub const NATIVE: Option<Self> = if cfg!(target_arch = "x86_64") {
        Some(Self::X86_64)
    } else if cfg!(target_arch = "aarch64") {
        Some(Self::AARCH64)
    } else {
        None
    };
}
