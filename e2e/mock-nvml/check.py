#!/usr/bin/env python3
"""Checks what `gpu-dra` reports through NVIDIA's mock NVML against the mock's profile YAML, and lists
where it differs from gpu-dra's own fake backend for the same GPU model. Called by run.sh.

  check.py PROFILE.yaml PROBE.txt STATIC.json DYNAMIC.json [FAKE_STATIC.json FAKE_DYNAMIC.json]

Prints one line per check: PASS, FAIL, KNOWN (a known limit of the mock; no failure) or DIFF (the mock
and our fake backend disagree; no failure, but each one is a question: whose model is wrong?).
Exits 1 when any check failed.
"""

import json
import re
import sys

try:
    import yaml
except ImportError:
    sys.exit("check.py needs PyYAML (apt-get install python3-yaml, or pip install pyyaml)")

ARCHITECTURES = {
    "kepler": "Kepler",
    "maxwell": "Maxwell",
    "pascal": "Pascal",
    "volta": "Volta",
    "turing": "Turing",
    "ampere": "Ampere",
    "ada_lovelace": "Ada Lovelace",
    "ada": "Ada Lovelace",
    "hopper": "Hopper",
    "blackwell": "Blackwell",
}
K8S = "resource.kubernetes.io"
# What a real node's NVML answers that the mock cannot know: PCIe roots come from the host's sysfs.
PER_NODE = {"uuid", "minor", f"{K8S}/pciBusID", f"{K8S}/pcieRoot", f"{K8S}/numaNode"}

failures = 0


# `gpu-dra devices --imex-channels`' default: the one channel device of a node (a node serves one
# ComputeDomain at a time).
DEFAULT_CHANNELS = 1


def report(kind, text):
    global failures
    if kind == "FAIL":
        failures += 1
    print(f"{kind} {text}")


def check(what, got, want):
    if got == want:
        report("PASS", f"{what}: {got!r}")
    else:
        report("FAIL", f"{what}: got {got!r}, the profile says {want!r}")


def semver(raw):
    """gpu-dra's version normalisation: `12.4` -> `12.4.0`, `550.90.07` -> `550.90.7`."""
    parts = [str(int(p)) for p in str(raw).split(".")]
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts[:3])


def devices_of(slices):
    out = {}
    for s in slices:
        for d in (s.get("spec", {}).get("devices") or []):
            out[d["name"]] = d
    return out


def attr(device, name):
    a = (device.get("attributes") or {}).get(name)
    if a is None:
        return None
    for kind in ("string", "int", "version", "bool"):
        if kind in a:
            return a[kind]
    return a


def memory(device):
    cap = (device.get("capacity") or {}).get("memory")
    return int(cap["value"]) if cap else None


def expected_gpus(profile):
    system = profile.get("system") or {}
    defaults = profile.get("device_defaults") or {}
    entries = profile.get("devices") or []
    count = system.get("num_devices") or len(entries) or 8
    count = min(count, 8)
    numa = {}
    for rc in (profile.get("pcie_topology") or {}).get("root_complexes") or []:
        for bdf in rc.get("devices") or []:
            numa[bdf.lower()] = rc.get("numa_node")
    nvlink = profile.get("nvlink") or {}
    gpus = []
    for index in range(count):
        entry = next((e for e in entries if e.get("index") == index), None)
        # The mock's minor is the entry's minor_number (0 when the entry leaves it out), else the index.
        minor = entry.get("minor_number", 0) if entry else index
        merged = dict(defaults)
        for key, value in (entry or {}).items():
            if key == "pci":
                merged["pci"] = {**(defaults.get("pci") or {}), **value}
            elif value is not None:
                merged[key] = value
        cc = merged.get("compute_capability") or {}
        bus = ((merged.get("pci") or {}).get("bus_id") or "").lower()
        fabric = merged.get("fabric") or {}
        mig = merged.get("mig") or {}
        gpus.append(
            {
                "index": index,
                "minor": minor,
                "uuid": (entry or {}).get("uuid"),
                "name": merged.get("name"),
                "memory": (merged.get("memory") or {}).get("total_bytes"),
                "bus": bus,
                "numa": numa.get(bus),
                "architecture": ARCHITECTURES.get(str(merged.get("architecture", "")).lower()),
                "cc": f"{cc.get('major')}.{cc.get('minor')}.0" if cc else None,
                "fabric": fabric,
                # The mock makes links only towards declared NVSwitches (B200 is its negative
                # control: links_per_gpu but no switch, so no active link).
                "nvlink": bool(nvlink.get("switches")),
                "mig_capable": bool(mig.get("max_gpu_instances")),
                "mig_enabled": mig.get("mode_current") == "enabled",
            }
        )
    return system, gpus


def fabric_domain(fabric):
    cluster = str(fabric.get("cluster_uuid") or "")
    state = str(fabric.get("state") or "completed").lower()
    if not cluster or set(cluster) <= {"0", "-"} or state not in ("auto", "completed"):
        return None
    return f"{cluster.lower()}.{fabric.get('clique_id', 0)}"


def is_fabric(domain):
    """`<cluster UUID>.<clique>` (a fabric domain) rather than a bare UUID (node-local)."""
    return bool(re.fullmatch(r"[0-9a-f-]{36}\.\d+", str(domain)))


def check_probe(probe, system, gpus):
    check("probe: GPU count", _first(r"^GPUs: (\d+)$", probe, int), len(gpus))
    check("probe: driver version", _first(r"^driver version: (.+)$", probe), system.get("driver_version"))
    events = _first(r"^  supported events: (.*)$", probe)
    if events is not None and "ECC" not in events:
        report("KNOWN", f"probe: the mock supports only {events} events, so gpu-dra watches no ECC events "
               "(real data-centre GPUs with ECC on support the ECC error events too)")
    errors = {}
    for line in probe.splitlines():
        if "error:" in line:
            errors[line.strip()] = errors.get(line.strip(), 0) + 1
    for line, count in errors.items():
        report("KNOWN", f"probe ({count} GPUs): {line}" if count > 1 else f"probe: {line}")


def _first(pattern, text, convert=str):
    m = re.search(pattern, text, re.M)
    return convert(m.group(1)) if m else None


def check_gpus(devices, system, gpus):
    whole = {n: d for n, d in devices.items() if attr(d, "type") == "gpu"}
    # A GPU in MIG mode is not published whole (static MIG publishes its MIG devices).
    check("devices: whole GPUs", len(whole), len([g for g in gpus if not g["mig_enabled"]]))
    domains = set()
    for g in gpus:
        name = f"gpu-{g['minor']}"
        if g["mig_enabled"]:
            continue
        d = whole.get(name)
        if d is None:
            report("FAIL", f"{name}: not published (have {sorted(whole)})")
            continue
        if g["uuid"]:
            check(f"{name} uuid", attr(d, "uuid"), g["uuid"])
        check(f"{name} productName", attr(d, "productName"), g["name"])
        check(f"{name} memory", memory(d), g["memory"])
        check(f"{name} pciBusID", attr(d, f"{K8S}/pciBusID"), g["bus"])
        check(f"{name} architecture", attr(d, "architecture"), g["architecture"])
        check(f"{name} cudaComputeCapability", attr(d, "cudaComputeCapability"), g["cc"])
        check(f"{name} driverVersion", attr(d, "driverVersion"), semver(system["driver_version"]))
        check(f"{name} cudaDriverVersion", attr(d, "cudaDriverVersion"), semver(system["cuda_version"]))
        check(f"{name} brand", attr(d, "brand"), "Nvidia")
        if g["numa"] is not None:
            check(f"{name} numaNode", attr(d, f"{K8S}/numaNode"), g["numa"])
        if attr(d, f"{K8S}/pcieRoot") is None:
            report("KNOWN", f"{name} pcieRoot: absent (gpu-dra reads it from the host's /sys, which has no such GPU)")
        domain = attr(d, "nvlinkDomain")
        want = fabric_domain(g["fabric"])
        if want:
            check(f"{name} nvlinkDomain (fabric cluster.clique)", domain, want)
            if "GB" not in str(g["name"]) and g["minor"] == gpus[0]["minor"]:
                report(
                    "KNOWN",
                    f"the mock gives {g['name']!r} a fabric cluster UUID; a real single-node NVLink "
                    "system (HGX) reports an all-zero one, from which gpu-dra derives a node-local "
                    "NVLink domain instead (as its fake does), while the mock puts the GPUs of every "
                    "mocked node into one domain",
                )
        elif g["nvlink"]:
            report("PASS" if domain else "FAIL", f"{name} nvlinkDomain: {domain!r} (NVLink links in the profile)")
            domains.add(domain)
        else:
            check(f"{name} nvlinkDomain (no NVLink)", domain, None)
    if len(domains) > 1:
        report("FAIL", f"GPUs linked by NVLink have {len(domains)} NVLink domains: {sorted(domains)}")


def check_channels(devices, gpus):
    """IMEX channel: published (channel 0) exactly where every GPU joined one fabric clique, carrying that
    clique and its number; none where any GPU has no completed fabric."""
    channels = {n: d for n, d in devices.items() if attr(d, "type") == "imex-channel"}
    cliques = {fabric_domain(g["fabric"]) for g in gpus}
    if len(cliques) == 1 and None not in cliques:
        clique = cliques.pop()
        check("IMEX channels published", len(channels), DEFAULT_CHANNELS)
        for n in range(DEFAULT_CHANNELS):
            d = channels.get(f"imex-channel-{n}")
            if d is None:
                report("FAIL", f"imex-channel-{n}: not published")
                continue
            if attr(d, "channel") != n or attr(d, "nvlinkDomain") != clique:
                report("FAIL", f"imex-channel-{n}: channel {attr(d, 'channel')!r}, nvlinkDomain {attr(d, 'nvlinkDomain')!r}; want {n}, {clique!r}")
        report("PASS", f"IMEX channel 0 carries clique {clique!r}")
    else:
        check("IMEX channels (no single completed fabric clique)", len(channels), 0)


def check_mig(static, dynamic, probe, gpus):
    for g in gpus:
        name = f"gpu-{g['minor']}"
        migs = sorted(n for n in dynamic if n.startswith(f"{name}-mig-"))
        needs_reset = g["architecture"] in ("Ampere",)
        if g["mig_enabled"]:
            # The mock lists no GPU-instance profile: the GPU must be reported, not silently dropped.
            unreadable = re.search(rf"^  GPU index {g['index']} .*unreadable, left out: (.*)$", probe, re.M)
            if unreadable and name not in static:
                report("PASS", f"{name} MIG mode on: reported unreadable ({unreadable.group(1)[:90]}...)")
                report("KNOWN", f"{name}: the mock implements no MIG profiles or instances, so a GPU in "
                       "MIG mode cannot be used through it")
            elif migs or any(n.startswith(f"{name}-mig-") for n in static):
                report("PASS", f"{name} MIG mode on: MIG devices published")
            else:
                report("FAIL", f"{name} MIG mode on: neither MIG devices nor an unreadable report")
        elif g["mig_capable"] and migs:
            report("PASS", f"{name} MIG capable: {len(migs)} dynamic MIG devices")
        elif g["mig_capable"] and needs_reset:
            report("PASS", f"{name} MIG capable, MIG mode off on {g['architecture']}: no dynamic MIG "
                   "devices (switching MIG mode on needs a GPU reset there)")
        elif g["mig_capable"]:
            report(
                "KNOWN",
                f"{name} MIG capable, no MIG devices: the mock answers NOT_SUPPORTED for "
                f"nvmlDeviceGetGpuInstanceProfileInfo and gpu-dra has no built-in MIG table for {g['name']!r}",
            )
        elif migs:
            report("FAIL", f"{name} is not MIG capable in the profile but publishes {migs[:3]}...")
        else:
            report("PASS", f"{name} not MIG capable: no MIG devices")
            if g["minor"] == gpus[0]["minor"] and re.search(r"^  MIG mode: current", probe, re.M):
                report("KNOWN", f"the mock answers nvmlDeviceGetMigMode for {g['name']!r}, which real "
                       "NVML answers NOT_SUPPORTED: gpu-dra labels such a node mig.capable=true")


def compare_with_fake(mock_static, mock_dynamic, fake_static, fake_dynamic):
    """DIFF lines for gpu-0 of each: attribute names and values a model fixes, memory, MIG devices."""
    mock = mock_static.get("gpu-0")
    fake = fake_static.get("gpu-0")
    if not mock or not fake:
        report("DIFF", "gpu-0 missing on one side; nothing compared")
        return
    keys = set(mock.get("attributes") or {}) | set(fake.get("attributes") or {})
    same = 0
    for key in sorted(keys):
        a, b = attr(mock, key), attr(fake, key)
        if a is None or b is None:
            if key == f"{K8S}/pcieRoot":
                continue  # host sysfs: see the KNOWN line above
            report("DIFF", f"attribute {key}: mock {a!r}, fake {b!r}")
        elif key == "nvlinkDomain" and is_fabric(a) != is_fabric(b):
            kinds = lambda v: "a fabric domain" if is_fabric(v) else "a node-local domain"
            report("DIFF", f"nvlinkDomain: mock {kinds(a)} {a!r}, fake {kinds(b)} {b!r}")
        elif key in PER_NODE or key in ("driverVersion", "cudaDriverVersion", "nvlinkDomain"):
            same += 1
        elif a != b:
            report("DIFF", f"attribute {key}: mock {a!r}, fake {b!r}")
        else:
            same += 1
    if memory(mock) != memory(fake):
        mib = lambda v: None if v is None else f"{v} ({v / 2**20:.0f} MiB)"
        report("DIFF", f"memory: mock {mib(memory(mock))}, fake {mib(memory(fake))}")
    report("INFO", f"{same} attributes agree between mock and fake (per-node values only by presence)")

    def mig_names(devices):
        return {n.split("-mig-", 1)[1] for n in devices if n.startswith("gpu-0-mig-")}

    a, b = mig_names(mock_dynamic), mig_names(fake_dynamic)
    if a != b:
        report("DIFF", f"gpu-0 dynamic MIG devices: only mock {sorted(a - b)}, only fake {sorted(b - a)}")
    else:
        report("INFO", f"gpu-0 dynamic MIG devices agree ({len(a)})")
    host = {f"{K8S}/pcieRoot"}  # from the host's sysfs: see the KNOWN line above
    for n in sorted(a & b):
        m, f = mock_dynamic[f"gpu-0-mig-{n}"], fake_dynamic[f"gpu-0-mig-{n}"]
        if m.get("capacity") != f.get("capacity"):
            report("DIFF", f"MIG device {n}: capacity mock {m.get('capacity')}, fake {f.get('capacity')}")
        names = lambda d: set(d.get("attributes") or {}) - host
        if names(m) != names(f):
            report("DIFF", f"MIG device {n}: attributes only mock {sorted(names(m) - names(f))}, "
                   f"only fake {sorted(names(f) - names(m))}")


def main(argv):
    if len(argv) not in (5, 7):
        sys.exit(__doc__)
    with open(argv[1]) as f:
        profile = yaml.safe_load(f)
    with open(argv[2]) as f:
        probe = f.read()
    load = lambda p: devices_of(json.load(open(p)))
    static, dynamic = load(argv[3]), load(argv[4])
    system, gpus = expected_gpus(profile)
    check_probe(probe, system, gpus)
    check_gpus(static, system, gpus)
    check_channels(static, gpus)
    check_mig(static, dynamic, probe, gpus)
    if len(argv) == 7:
        compare_with_fake(static, dynamic, load(argv[5]), load(argv[6]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
