#!/usr/bin/env python3
"""Renders and lints the Helm chart in deploy/helm/ with Helm's own engine, for tests/manifests/helm_chart.rs.

The engine is Helm v4's Go SDK, which the Python package helm-python-sdk (import name helm_python) binds
through ctypes: Chart.load / Chart.render for `helm template`, lint() for `helm lint`. No helm binary and no
cluster are needed.

    helm_render.py requirement                  the pip requirement
    helm_render.py install DIR                  make DIR hold the pinned engine (pip --target), unless it
                                                does already; `cargo test` runs this for target/tmp/helm-engine
    helm_render.py render CHART [options]       JSON {template path: rendered text}
    helm_render.py render CHART --yaml [...]    one YAML stream, as `helm template` prints it
    helm_render.py lint CHART [options]         JSON report of helm lint
options: --values FILE (YAML, as helm's -f), --set-json JSON (a values object, over the file's),
         --include-crds (render: the chart's crds/ first, as helm install applies them)

Exit status: 0 done, 1 Helm refused the chart or the values (its message on stderr), 2 usage, 3 the engine
is not installed or could not be (stderr says why, and how to install it).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

# The one place that names the version: `install` puts what `requirement` prints under target/.
REQUIREMENT = "helm-python-sdk==0.2.2"
RELEASE = "gpu-dra"


def fail(status, message):
    print(message, file=sys.stderr)
    sys.exit(status)


HOW_TO_INSTALL = (
    f"`cargo test` installs it under target/tmp/helm-engine by itself; by hand:\n"
    f"  python3 -m pip install {REQUIREMENT}"
)


def installed_version():
    """The version of helm_python this interpreter imports, or None."""
    try:
        import helm_python
    except ImportError:
        return None
    return helm_python.__version__


def engine():
    try:
        import helm_python
    except ImportError as e:
        fail(3, f"helm_render.py: the Helm engine is not installed ({e}); {HOW_TO_INSTALL}")
    wanted = REQUIREMENT.split("==")[1]
    if helm_python.__version__ != wanted:
        fail(
            3,
            f"helm_render.py: helm-python-sdk {helm_python.__version__} is installed, the tests pin {wanted}; "
            f"{HOW_TO_INSTALL}",
        )
    return helm_python


def install(target):
    """Makes `target` a directory that, on PYTHONPATH, imports the pinned engine.

    pip installs into a directory of this process's own and that is renamed into place, so test processes
    running at once (cargo nextest runs each test in its own) never see half an install. A `target` holding
    another version (the pin moved) is replaced. An engine this interpreter already imports at the pinned
    version (installed by hand) is used as it is."""
    wanted = REQUIREMENT.split("==")[1]
    sys.path.insert(0, target)
    if installed_version() == wanted:
        return
    if sys.version_info < (3, 10):
        fail(3, f"helm_render.py: helm-python-sdk needs Python 3.10 or later, this is {sys.version.split()[0]}")
    parent = os.path.dirname(os.path.abspath(target)) or "."
    os.makedirs(parent, exist_ok=True)
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    print(f"helm_render.py: installing {REQUIREMENT} into {target} (once per build directory)", file=sys.stderr)
    done = subprocess.run(
        pip + ["--target", partial, REQUIREMENT],
        env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        said = done.stdout.strip() or f"exit status {done.returncode}"
        if "No module named pip" in said:
            said += "\n(this Python has no pip: install it, e.g. Debian's python3-pip)"
        fail(3, f"helm_render.py: could not install {REQUIREMENT} into {target}:\n{said}")
    if os.path.isdir(target):
        # Another version, or another process's install that just landed: either way ours replaces it
        # only when what is there is not the pinned version.
        check = subprocess.run(
            [sys.executable, "-c", "import helm_python; print(helm_python.__version__)"],
            env=dict(os.environ, PYTHONPATH=target),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if check.stdout.strip() == wanted:
            shutil.rmtree(partial, ignore_errors=True)
            return
        stale = f"{target}.stale-{os.getpid()}"
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(partial, target)
    except OSError:
        # Another process renamed its own install into place first.
        shutil.rmtree(partial, ignore_errors=True)


def merge(base, override):
    """Helm CLI's merge of -f files and --set-json: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def values(helm, args):
    result = {}
    if args.values:
        with open(args.values, encoding="utf-8") as f:
            result = helm.values_from_yaml(f.read())
    if args.set_json:
        override = json.loads(args.set_json)
        if not isinstance(override, dict):
            raise ValueError("--set-json must be a JSON object")
        result = merge(result, override)
    return result


def render(helm, args):
    with helm.Chart.load(args.chart) as chart:
        manifests = chart.render(
            values(helm, args),
            name=RELEASE,
            namespace=args.release_namespace,
            is_install=True,
        )
        crds = chart.crds if args.include_crds else []
    # NOTES.txt is text for the user, not an object; partials (_helpers.tpl) render to nothing.
    manifests = {
        path: text
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt") and text.strip()
    }
    if not args.yaml:
        out = {c["name"]: c["data"] for c in crds}
        out.update(manifests)
        json.dump(out, sys.stdout, indent=1)
        return
    for crd in crds:
        sys.stdout.write(f"---\n# Source: {crd['filename']}\n{crd['data'].strip()}\n")
    for path, text in manifests.items():
        sys.stdout.write(f"---\n# Source: {path}\n{text.strip()}\n")


def lint(helm, args):
    report = helm.lint(
        args.chart,
        values(helm, args),
        strict=True,
        namespace=args.release_namespace,
    )
    json.dump(report, sys.stdout, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("requirement")
    commands.add_parser("install").add_argument("dir")
    for name in ("render", "lint"):
        command = commands.add_parser(name)
        command.add_argument("chart")
        command.add_argument("--values")
        command.add_argument("--set-json")
        command.add_argument("--release-namespace", default="default")
        if name == "render":
            command.add_argument("--include-crds", action="store_true")
            command.add_argument("--yaml", action="store_true")
    args = parser.parse_args()
    if args.command == "requirement":
        print(REQUIREMENT)
        return
    if args.command == "install":
        install(args.dir)
        return
    helm = engine()
    try:
        (render if args.command == "render" else lint)(helm, args)
    except (helm.HelmError, OSError, ValueError) as e:
        fail(1, f"helm_render.py {args.command} {args.chart}: {e}")


if __name__ == "__main__":
    main()
