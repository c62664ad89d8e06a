#!/usr/bin/env python3
"""The run half of scripts/gpu-check.sh: every check of the CUDA path on a GPU
machine, each under its own timeout and all under one budget, into
report.md and report.json (rewritten after every check, so a run cut short
still leaves its report).

  scripts/gpu-check.sh run --out DIR [--prepared .gpu] [--budget 450]
                           [--only a,b] [--timeout S|NAME=S,...] [--device cuda|cpu]
                           [--binary PATH] [--fake-gpus 'NAME,MiB,DRIVER,CC;...']

What it does:
  1. unpacks the prepared folder's shardnet.xz (or takes --binary);
  2. finds the GPUs (nvidia-smi) and the libraries the binary needs by name
     (libcudart.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10,
     libnvrtc.so.13, libnccl.so.2) in the Python environment's nvidia
     packages (PyTorch's), CUDA_HOME and ldconfig, never at a path of the
     machine that built it; prints and records the versions;
  3. runs the checks (`checks` below, in that order) while sampling every
     GPU's used memory, and records status, seconds, figures and the
     output's tail of each. A check that outlives its timeout is killed with
     its whole process group; one that cannot start within the budget is
     skipped. Nothing it runs can keep the run from ending.

Exit status: 0 when every check passed, 1 when any failed, timed out or was
skipped, 2 for a bad argument. For tests on a machine without a GPU:
--fake-gpus stands in for nvidia-smi, --binary for the prepared binary, and
--device cpu runs every check on the CPU instead (the same flags otherwise).
"""
import argparse
import datetime
import glob
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The libraries a `cuda,nccl` build asks for by name, and the driver's.
LIBRARIES = ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
             "libnvrtc.so.13", "libnccl.so.2"]
DRIVER = "libcuda.so.1"
# Seconds kept back from the budget for writing the report.
RESERVE = 5.0


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Check:
    """One check: a command, its timeout, and what makes it pass."""

    def __init__(self, name, title, argv, timeout, judge=None, metrics=None):
        self.name, self.title, self.argv, self.timeout = name, title, argv, timeout
        self.judge = judge or (lambda rc, out, figures: (rc == 0, "" if rc == 0 else last_error(out)))
        self.metrics = metrics  # a --metrics file to read figures from


def last_error(out):
    """The most telling line of a failed command's output."""
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    for l in reversed(lines):
        if re.search(r"error|failed|panicked|Traceback|Error", l):
            return l[:400]
    return lines[-1][:400] if lines else "no output"


def shardnet_figures(path):
    """Figures from a `--metrics` file: samples/s, ms per step, accuracy, peak host memory."""
    try:
        m = json.load(open(path))
    except (OSError, ValueError):
        return {}
    e = (m.get("epochs") or [{}])[-1]
    f = {}
    if e.get("samples_per_s"):
        f["samples_per_s"] = round(e["samples_per_s"], 1)
    for k in ("train_loss", "train_accuracy", "test_accuracy"):
        if e.get(k) is not None:
            f[k] = round(e[k], 4)
    peaks = m.get("peak_memory_bytes") or []
    if peaks:
        f["peak_host_mib"] = round(max(peaks) / 2**20, 1)
    return f


def checks(a, bin_path, tmp, data):
    """The checks, in the order they run: what matters most first."""
    dev = ["--device", a.device]
    py = sys.executable or "python3"
    peers = a.peers
    m = lambda name: os.path.join(tmp, name + ".json")

    def trained(rc, out, figures):
        acc = figures.get("test_accuracy")
        if rc != 0:
            return False, last_error(out)
        if acc is None or acc < 0.9:
            return False, f"test accuracy {acc} below 0.9"
        return True, ""

    def refused(rc, out, figures):
        if rc != 0 and "Duplicate GPU detected" in out:
            return True, "refused before NCCL was called, with NCCL's reason"
        if rc == 0:
            return False, "two ranks on one GPU were not refused"
        return False, last_error(out)

    head = ["--classes", "1000000", "--dim", "512", "--batch-size", "256", "--optimizer", "sgd"]
    gpt = ["--layers", "6", "--dim", "384", "--heads", "6", "--seq", "256", "--batch-size", "8"]
    fortunes = os.path.join(data, "fortunes")
    steps, warm = 25, 5
    out = [
        Check("versions", "Python, PyTorch, CUDA and NCCL versions",
              [py, "-c", "import json, torch; print(json.dumps({'python': __import__('sys').version.split()[0], "
               "'torch': torch.__version__, 'torch_cuda': torch.version.cuda, "
               "'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None, "
               "'gpus': torch.cuda.device_count()}))"], 90),
        Check("selftest-1", "conformance suite, 1 rank", [bin_path, "selftest", "--ranks", "1", *dev], 120),
        Check("mnist-mlp", "train mnist-mlp, 1 rank, 1 epoch (test accuracy ≥ 90%)",
              [bin_path, "train", "mnist-mlp", "--ranks", "1", *dev, "--epochs", "1",
               "--batch-size", "100", "--metrics", m("mnist-mlp")], 150, trained, m("mnist-mlp")),
        Check("face-head", "face-head, 1,000,000 classes × 512, batch 256, SGD",
              [bin_path, "train", "face-head", "--ranks", "1", *dev, *head,
               "--max-steps", str(steps), "--warmup-steps", str(warm), "--steps-per-epoch", str(steps),
               "--epochs", "1", "--no-eval", "--metrics", m("face-head")], 150, None, m("face-head")),
        Check("face-head-torch", "PyTorch's face head, same sizes and optimizer",
              [py, os.path.join(peers, "torch_face_head.py"), "--ranks", "1", *dev, *head,
               "--steps", str(steps - warm), "--warmup", str(warm)], 150),
        Check("vgg16", "VGG16 32×32, batch 128, Adam",
              [bin_path, "train", "vgg16", "--ranks", "1", *dev, "--dataset", "synthetic",
               "--synthetic-examples", str(128 * (steps + 1)), "--batch-size", "128",
               "--max-steps", str(steps), "--warmup-steps", str(warm), "--no-eval",
               "--metrics", m("vgg16")], 150, None, m("vgg16")),
        Check("vgg16-torch", "PyTorch's VGG16, same model and optimizer",
              [py, os.path.join(peers, "torch_vgg16.py"), "--batch", "128", *dev,
               "--steps", str(steps - warm), "--warmup", str(warm)], 150),
        Check("selftest-nccl-1", "conformance suite through NCCL, 1 rank",
              [bin_path, "selftest", "--ranks", "1", *dev, "--communicator", "nccl"], 120),
        Check("nccl-refused-2", "NCCL with 2 ranks on 1 GPU is refused before NCCL is called",
              [bin_path, "selftest", "--ranks", "2", *dev, "--communicator", "nccl"], 60, refused),
        Check("selftest-2", "conformance suite, 2 thread ranks sharing the GPU (host communicator)",
              [bin_path, "selftest", "--ranks", "2", *dev], 120),
        Check("selftest-4", "conformance suite, 4 thread ranks sharing the GPU (host communicator)",
              [bin_path, "selftest", "--ranks", "4", *dev], 150),
        Check("mnist-mlp-2", "train mnist-mlp split over 2 ranks sharing the GPU (test accuracy ≥ 90%)",
              [bin_path, "train", "mnist-mlp", "--ranks", "2", *dev, "--epochs", "1",
               "--batch-size", "100", "--metrics", m("mnist-mlp-2")], 150, trained, m("mnist-mlp-2")),
        Check("gpt", "GPT L = 6, D = 384, H = 6, T = 256, batch 8 on fortunes, AdamW",
              [bin_path, "train", "gpt", "--ranks", "1", *dev, *gpt, "--max-steps", str(steps),
               "--warmup-steps", str(warm), "--lr-warmup", "2", "--no-eval", "--corpus", fortunes,
               "--metrics", m("gpt")], 150, None, m("gpt")),
        Check("gpt-torch", "PyTorch's GPT, same model, data and optimizer",
              [py, os.path.join(peers, "torch_gpt.py"), "--scheme", "single", *dev, *gpt,
               "--steps", str(steps - warm), "--warmup", str(warm), "--corpus", fortunes], 150),
    ]
    return out


def peer_figures(name, out):
    """Figures from a PyTorch peer's output."""
    f = {}
    if name in ("versions", "face-head-torch", "gpt-torch"):
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if name == "versions":
                    f.update(j)
                elif name == "gpt-torch":
                    f["samples_per_s"] = round(j["tokens_per_s"], 1)
                    f["ms_per_step"] = round(j["step_ms"], 2)
                    if j.get("peak_gpu_bytes"):
                        f["peak_torch_allocated_mib"] = round(j["peak_gpu_bytes"] / 2**20, 1)
                else:
                    f["ms_per_step"] = round(j["step_ms"], 2)
                    f["samples_per_s"] = round(j["batch_size"] * 1e3 / j["step_ms"], 1)
                    if j.get("peak_gpu_bytes"):
                        f["peak_torch_allocated_mib"] = round(j["peak_gpu_bytes"] / 2**20, 1)
    elif name == "vgg16-torch":
        rows = [l for l in out.splitlines() if l.startswith("vgg16,")]
        if rows:
            cols = rows[-1].split(",")
            f["samples_per_s"] = float(cols[5])
            f["ms_per_step"] = float(cols[6])
        g = re.search(r"# peak_gpu_bytes (\d+)", out)
        if g:
            f["peak_torch_allocated_mib"] = round(int(g.group(1)) / 2**20, 1)
    return f


def gpus(fake):
    """The GPUs: [{index, name, memory_mib, driver, compute_cap}], and a note when none."""
    if fake is not None:
        rows = [r for r in fake.split(";") if r.strip()]
        out = []
        for i, r in enumerate(rows):
            name, mib, driver, cc = (r.split(",") + ["", "", "", ""])[:4]
            out.append({"index": i, "name": name.strip(), "memory_mib": int(mib or 0),
                        "driver": driver.strip(), "compute_cap": cc.strip(), "fake": True})
        return out, "fake device list (--fake-gpus)"
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], "nvidia-smi not found: no NVIDIA driver on this machine"
    try:
        p = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version,compute_cap",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    out = []
    for line in p.stdout.splitlines():
        c = [x.strip() for x in line.split(",")]
        if len(c) >= 5 and c[0].isdigit():
            out.append({"index": int(c[0]), "name": c[1], "memory_mib": int(float(c[2] or 0)),
                        "driver": c[3], "compute_cap": c[4]})
    return out, "" if out else f"nvidia-smi lists no GPU: {(p.stdout + p.stderr).strip()[:300]}"


class MemorySampler:
    """Every GPU's used memory (nvidia-smi), sampled while a check runs: the peak
    above what was in use when it started."""

    def __init__(self, enabled):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.stop = threading.Event()
        self.peak, self.base = None, None

    def read(self):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=5)
            return [float(x) for x in p.stdout.split()]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def __enter__(self):
        if self.enabled:
            self.base = self.read()
            self.thread = threading.Thread(target=self.loop, daemon=True)
            self.thread.start()
        return self

    def loop(self):
        while not self.stop.wait(0.25):
            used = self.read()
            if used and self.base and len(used) == len(self.base):
                rise = max(u - b for u, b in zip(used, self.base))
                self.peak = rise if self.peak is None else max(self.peak, rise)

    def __exit__(self, *exc):
        self.stop.set()
        if self.enabled:
            self.thread.join(timeout=10)


def run_check(c, timeout, env, log, sample):
    """Run one check under `timeout` seconds: (status, rc, seconds, output, peak GPU MiB)."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(c.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError as e:
        return "fail", None, 0.0, f"could not start {c.argv[0]}: {e}", None
    with MemorySampler(sample) as mem:
        try:
            out, _ = p.communicate(timeout=timeout)
            status = "done"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                out = b""
            status = "timeout"
    text = out.decode("utf-8", "replace") if out else ""
    secs = time.monotonic() - t0
    log.write(f"\n===== {c.name} ({status}, rc {p.returncode}, {secs:.1f} s): {' '.join(c.argv)}\n")
    log.write(text[-200_000:])
    log.flush()
    return status, p.returncode, secs, text, mem.peak


def find_libraries():
    """Each needed library by name: the directory holding it, searched in the Python
    environment's nvidia packages, CUDA_HOME and ldconfig's cache."""
    dirs = []
    for base in sys.path:
        for pattern in ("nvidia/*/lib", "nvidia/*/*/lib", "nvidia/*/lib64"):
            dirs += sorted(glob.glob(os.path.join(base, pattern)))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            dirs += [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    cache = {}
    try:
        p = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20)
        for line in p.stdout.splitlines():
            mm = re.match(r"\s*(\S+) .*=> (\S+)", line)
            if mm:
                cache.setdefault(mm.group(1), mm.group(2))
    except (OSError, subprocess.TimeoutExpired):
        pass
    found = {}
    for name in LIBRARIES + [DRIVER]:
        where = next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))),
                     cache.get(name))
        found[name] = {"path": where, "file": os.path.basename(os.path.realpath(where)) if where else None}
    return found


def render(report):
    """report.md from the report's JSON."""
    r = report
    s = [f"# GPU check: {r['status']}", "",
         f"Started {r['started']}, finished {r.get('finished') or '(running)'}; budget {r['budget_s']} s; "
         f"device flag `--device {r['device']}`; binary {r['binary']}.", ""]
    if r["gpus"]:
        for g in r["gpus"]:
            s.append(f"- GPU {g['index']}: {g['name']}, {g['memory_mib']} MiB, driver {g['driver']}, "
                     f"compute capability {g['compute_cap']}{' (fake)' if g.get('fake') else ''}")
    else:
        s.append(f"- no GPU: {r['gpu_note']}")
    for name, lib in r["libraries"].items():
        s.append(f"- {name}: {lib['path'] or 'not found'}"
                 + (f" ({lib['file']})" if lib["file"] and lib["file"] != name else ""))
    if r.get("missing_libraries"):
        s.append(f"- the binary asks for libraries not found: {', '.join(r['missing_libraries'])}")
    s += ["", "| check | status | seconds | figures | note |", "|---|---|---|---|---|"]
    for c in r["checks"]:
        figs = ", ".join(f"{k} {v}" for k, v in c["figures"].items())
        note = (c["reason"] or "").replace("|", "\\|").replace("\n", " ")
        secs = "" if c["seconds"] is None else f"{c['seconds']:.1f}"
        s.append(f"| {c['name']}: {c['title']} | {c['status']} | {secs} | {figs} | {note} |")
    pairs = [("face-head", "face-head-torch"), ("vgg16", "vgg16-torch"), ("gpt", "gpt-torch")]
    by = {c["name"]: c for c in r["checks"]}
    rows = []
    for ours, theirs in pairs:
        a, b = by.get(ours), by.get(theirs)
        if a and b and a["figures"].get("samples_per_s") and b["figures"].get("samples_per_s"):
            fa, fb = a["figures"], b["figures"]
            rows.append(f"| {ours} | {fa['samples_per_s']} | {fb['samples_per_s']} | "
                        f"{fa['samples_per_s'] / fb['samples_per_s']:.2f}× | "
                        f"{fa.get('peak_gpu_mib', '')} | {fb.get('peak_gpu_mib', '')} |")
    if rows:
        s += ["", "| model | shardnet samples/s (GPT: tokens/s) | PyTorch | ratio | shardnet peak GPU MiB | "
              "PyTorch peak GPU MiB |", "|---|---|---|---|---|---|", *rows]
    s += ["", f"Summary: {r['summary']}", ""]
    return "\n".join(s)


def write(out_dir, report):
    """Write report.json and report.md, each atomically."""
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", render(report))):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


def summarise(report):
    counts = {}
    for c in report["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    report["summary"] = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no checks"
    bad = any(c["status"] not in ("pass", "pending") for c in report["checks"])
    report["status"] = "failures" if bad else "all passed"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for report.md, report.json and log.txt")
    ap.add_argument("--prepared", default=None, help="the folder `prepare` made (default .gpu)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    ap.add_argument("--timeout", default=None,
                    help="seconds for every check (S), or for some (NAME=S,NAME=S)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--binary", default=None, help="a shardnet binary instead of the prepared one")
    ap.add_argument("--fake-gpus", default=None, help="'NAME,MiB,DRIVER,CC;...' instead of nvidia-smi")
    a = ap.parse_args()
    t_start = time.monotonic()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prepared = os.path.abspath(a.prepared or os.path.join(root, ".gpu"))
    a.peers = os.path.join(prepared, "peers") if os.path.isdir(os.path.join(prepared, "peers")) \
        else os.path.join(root, "bench")
    os.makedirs(a.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    report = {"started": now(), "finished": None, "budget_s": a.budget, "device": a.device,
              "binary": None, "gpus": [], "gpu_note": "", "libraries": {}, "checks": [],
              "status": "running", "summary": ""}
    log = open(os.path.join(a.out, "log.txt"), "w")
    code = 1
    try:
        if a.binary:
            bin_path = os.path.abspath(a.binary)
            report["binary"] = bin_path
        else:
            packed = os.path.join(prepared, "shardnet.xz")
            if not os.path.exists(packed):
                raise SystemExit(f"gpu-check: {packed} is missing: run `scripts/gpu-check.sh prepare` "
                                 "first and carry its folder")
            bin_path = os.path.join(tmp, "shardnet")
            with lzma.open(packed) as src, open(bin_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(bin_path, 0o755)
            manifest = os.path.join(prepared, "manifest.json")
            report["binary"] = json.load(open(manifest)) if os.path.exists(manifest) else packed
        report["gpus"], report["gpu_note"] = gpus(a.fake_gpus)
        libs = find_libraries()
        report["libraries"] = libs
        env = dict(os.environ)
        lib_dirs = []
        for name in LIBRARIES:
            p = libs[name]["path"]
            if p and os.path.dirname(p) not in lib_dirs:
                lib_dirs.append(os.path.dirname(p))
        env["LD_LIBRARY_PATH"] = ":".join(lib_dirs + [x for x in [env.get("LD_LIBRARY_PATH")] if x])
        data = os.path.join(prepared, "data")
        if os.path.isdir(os.path.join(data, "mnist")):
            env["SHARDNET_DATA"] = data
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            ldd = subprocess.run(["ldd", bin_path], capture_output=True, text=True, timeout=20, env=env)
            report["missing_libraries"] = re.findall(r"(\S+) => not found", ldd.stdout)
        except (OSError, subprocess.TimeoutExpired):
            report["missing_libraries"] = []
        for g in report["gpus"]:
            print(f"gpu-check: GPU {g['index']}: {g['name']}, {g['memory_mib']} MiB, driver {g['driver']}")
        if not report["gpus"]:
            print(f"gpu-check: {report['gpu_note']}")
        for name, lib in libs.items():
            print(f"gpu-check: {name}: {lib['path'] or 'not found'}")
        todo = checks(a, bin_path, tmp, data)
        known = [c.name for c in todo]
        if a.only:
            wanted = [n.strip() for n in a.only.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in known]
            if unknown:
                msg = f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(known)}"
                print(f"gpu-check: {msg}", file=sys.stderr)
                report["status"], report["summary"] = "could not run", msg
                return 2
            todo = [c for c in todo if c.name in wanted]
        timeouts = {}
        for part in (a.timeout or "").split(","):
            name, _, secs = part.rpartition("=")
            if part.strip():
                try:
                    timeouts[name.strip() or "*"] = float(secs)
                except ValueError:
                    raise SystemExit(f"gpu-check: --timeout {a.timeout!r}: give seconds, or NAME=S,NAME=S")
        for c in todo:
            report["checks"].append({"name": c.name, "title": c.title, "command": " ".join(c.argv),
                                     "status": "pending", "rc": None, "seconds": None, "figures": {},
                                     "reason": "", "output_tail": ""})
        summarise(report)
        write(a.out, report)
        sample = a.device == "cuda" and a.fake_gpus is None
        for c, entry in zip(todo, report["checks"]):
            left = a.budget - (time.monotonic() - t_start) - RESERVE
            timeout = min(timeouts.get(c.name, timeouts.get("*", c.timeout)), left)
            if left < 5:
                entry.update(status="skipped", reason=f"out of time: {left:.0f} s of the budget left")
                continue
            print(f"gpu-check: {c.name}: {c.title} (at most {timeout:.0f} s)", flush=True)
            status, rc, secs, text, peak = run_check(c, timeout, env, log, sample)
            figures = shardnet_figures(c.metrics) if c.metrics else peer_figures(c.name, text)
            if c.metrics and figures.get("samples_per_s"):
                flag = lambda f: next((c.argv[i + 1] for i, x in enumerate(c.argv) if x == f), None)
                bs = flag("--batch-size")
                if bs:
                    # The GPT counts tokens: windows × T per step.
                    per_step = int(bs) * int(flag("--seq") or 1)
                    figures["ms_per_step"] = round(per_step * 1e3 / figures["samples_per_s"], 2)
            if peak is not None:
                figures["peak_gpu_mib"] = round(peak, 1)
            if status == "timeout":
                ok, reason = False, f"killed after {timeout:.0f} s (its timeout)"
            else:
                ok, reason = c.judge(rc, text, figures)
            entry.update(status="pass" if ok else ("timeout" if status == "timeout" else "fail"),
                         rc=rc, seconds=round(secs, 1), figures=figures, reason=reason,
                         output_tail=text[-3000:])
            print(f"gpu-check: {c.name}: {entry['status']} in {secs:.1f} s"
                  + (f": {reason}" if reason else "") + (f" {figures}" if figures else ""), flush=True)
            summarise(report)
            write(a.out, report)
        summarise(report)
        code = 0 if report["status"] == "all passed" else 1
    except SystemExit as e:
        report["status"] = "could not run"
        report["summary"] = str(e)
        print(e, file=sys.stderr)
        code = 1
    except Exception as e:  # the report is written whatever happens
        report["status"] = "could not run"
        report["summary"] = f"{type(e).__name__}: {e}"
        print(f"gpu-check: {report['summary']}", file=sys.stderr)
        code = 1
    finally:
        report["finished"] = now()
        write(a.out, report)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"gpu-check: {report['status']} ({report['summary']}); report in {a.out}/report.md")
    return code


if __name__ == "__main__":
    sys.exit(main())
