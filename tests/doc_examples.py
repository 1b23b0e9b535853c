#!/usr/bin/env python3
"""The README's and docs' `./tandem ...` example commands, as written (issue 16, item 5).

Every `./tandem` command line in README.md and docs/*.md (inline `code` spans, indented
and fenced code blocks, `\\` continuations joined, trailing `# comments` dropped) must
name a real subcommand, and every flag it uses must be one that subcommand takes:

  up                  run for real with --dry-run (the whole parse, values included;
                      nothing is built or started); the README's cluster.yaml example
                      is written out and used for `--config cluster.yaml`. A command
                      with placeholders (`--tp N`, `...`) has its flag names checked
                      against `./tandem up --help` instead.
  bench NAME          NAME is one of `./tandem bench --help`'s list, and each flag is in
                      the --help of the binary the script runs for NAME (read from the
                      script's own dispatch); `kernels` flags against the bench help.
  generate            each flag in `./tandem generate --help` and in the --help of the
                      binary it runs (tools/generate_client with --router, else
                      engine/runtime/generate).
  other subcommands   each flag in `./tandem CMD --help`.

Flag names compare with hyphens and underscores alike (every binary takes both).
A self-test first checks that a wrong flag, subcommand or benchmark is caught.

Run by tests:doc_examples_test from the runfiles root.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

RUNFILES = os.getcwd()
TMP = os.environ.get("TEST_TMPDIR", "/tmp")
DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir("docs") if f.endswith(".md"))
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|^\.\.\.$|^<.*>$")

_help_cache = {}


def norm(flag):
    return flag.lstrip("-").split("=", 1)[0].replace("-", "_")


def run(argv, cwd=RUNFILES, timeout=60):
    env = dict(os.environ, BAZEL="true", TANDEM_CACHE_DIR=os.path.join(TMP, "cache"))
    p = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout, text=True)
    return p.returncode, p.stdout


def help_flags(argv):
    """The flag names (normalised) that `argv` (a --help call) prints."""
    key = tuple(argv)
    if key not in _help_cache:
        rc, out = run(argv)  # absl's --help exits 1
        if "Usage" not in out and "usage" not in out and "--" not in out:
            raise RuntimeError(f"{' '.join(argv)} exited {rc}, printing no usage:\n{out}")
        _help_cache[key] = ({norm(f) for f in re.findall(r"--[a-z][a-z0-9_-]*", out)} |
                            {norm(f) for f in re.findall(r"--\[no-?\]([a-z][a-z0-9_-]*)", out)})
    return _help_cache[key]


def bench_dispatch():
    """NAME -> workspace path of the binary `./tandem bench NAME` runs, from the script."""
    text = open("tandem").read()
    body = text[text.index("cmd_bench() {"):]
    body = body[:body.index("\n}\n")]
    table, names = {}, []
    for line in body.splitlines():
        m = re.match(r"^    ([a-z][a-z0-9_ |]*)\)", line)
        if m:
            names = [n.strip() for n in m.group(1).split("|")]
        m = re.search(r"run_binary //([^ :]+):(\S+)", line)
        if m and names:
            for n in names:
                table.setdefault(n, f"{m.group(1)}/{m.group(2)}")
    return table


def benches():
    rc, out = run(["./tandem", "bench", "--help"])
    m = re.search(r"^Benchmarks: (.*)$", out, re.M)
    assert rc == 0 and m, out
    return m.group(1).split(), out


BENCHES, BENCH_HELP = benches()
DISPATCH = bench_dispatch()
SUBCOMMANDS = set(re.findall(r"^  ([a-z][a-z-]+) ", run(["./tandem", "help"])[1], re.M))


def commands_in(path):
    """(line number, command text) of every `./tandem` example in a markdown file."""
    text = open(path).read()
    found = []
    # Inline code spans (may wrap across lines).
    for m in re.finditer(r"(?<!`)`(\./tandem(?: [^`]*)?)`(?!`)", text):
        found.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    # Code blocks: indented by 4+ spaces after a blank line, or fenced.
    lines = text.splitlines()
    in_fence, prev_blank, in_indented = False, True, False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            i += 1
            continue
        in_indented = (line.startswith("    ") and (prev_blank or in_indented)
                       and not line.lstrip().startswith(("-", "*", "|")))
        code = in_fence or in_indented
        prev_blank = not line.strip()
        start = i
        if code and "./tandem " in line or (code and line.strip() == "./tandem"):
            cmd = line[line.index("./tandem"):]
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            cmd = re.sub(r"\s+#.*$", "", cmd)  # a trailing comment
            found.append((start + 1, " ".join(cmd.split())))
        i += 1
    return found


def readme_cluster_yaml():
    """The README's cluster.yaml example (the left column of its code block)."""
    lines = open("README.md").read().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("# cluster.yaml") and "--config cluster.yaml" in line:
            body = []
            for l in lines[i + 1:]:
                if not l.strip():
                    break
                body.append(l.strip())
            return "\n".join(body) + "\n"
    return None


def check(cmd):
    """'' if the example is right, else what is wrong."""
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        return f"does not split as a shell command: {e}"
    # Optional parts written [--k 3], alternatives a|b stay values.
    argv = [a.strip("[]") for a in argv if a.strip("[]")]
    if argv[0] != "./tandem":
        return "not a ./tandem command"
    if len(argv) == 1:
        return ""  # ./tandem alone prints the help
    sub, args = argv[1], argv[2:]
    if sub in ("help", "-h", "--help"):
        return ""
    if sub not in SUBCOMMANDS:
        return f"no subcommand '{sub}' (./tandem help lists {sorted(SUBCOMMANDS)})"
    flags = [a for a in args if a.startswith("--")]
    placeholders = [a for a in args if PLACEHOLDER.match(a)]

    def missing(known, where):
        bad = []
        for f in flags:
            n = norm(f)
            if n in known or (n.startswith("no") and n[2:] in known):
                continue
            bad.append(f)
        return f"{where} does not take {bad}" if bad else ""

    if sub == "up":
        if placeholders:
            return missing(help_flags(["./tandem", "up", "--help"]), "./tandem up --help")
        # As a user runs it: from the checkout's root (the script resolves paths
        # there), which holds the README's cluster.yaml.
        cwd = os.path.join(TMP, "root")
        if not os.path.isdir(cwd):
            os.makedirs(cwd)
            shutil.copy("tandem", cwd)
            os.symlink(os.path.join(RUNFILES, "tools"), os.path.join(cwd, "tools"))
            yaml = readme_cluster_yaml()
            if yaml is not None:
                open(os.path.join(cwd, "cluster.yaml"), "w").write(yaml)
        rc, out = run(["./tandem", "up"] + args + ["--dry-run", "--no-setup"], cwd=cwd)
        return "" if rc == 0 else f"./tandem up ... --dry-run exited {rc}:\n{out}"
    if sub == "bench":
        if not args or args[0].startswith("-"):
            return "" if not args or args == ["--help"] else "bench needs NAME"
        name, flags = args[0], [a for a in args[1:] if a.startswith("--")]
        if PLACEHOLDER.match(name):  # ./tandem bench NAME
            return ""
        if name not in BENCHES and name not in DISPATCH:
            return f"no benchmark '{name}' (./tandem bench --help lists {BENCHES})"
        if name == "kernels":
            known = help_flags(["./tandem", "bench", "--help"])
            where = "./tandem bench --help (kernels)"
        elif name in DISPATCH:
            known = help_flags([DISPATCH[name], "--help"])
            where = f"{DISPATCH[name]} (./tandem bench {name})"
        else:
            return f"./tandem bench {name}: no binary in the script's dispatch"
        bad = [f for f in flags if norm(f) not in known and
               not (norm(f).startswith("no") and norm(f)[2:] in known)]
        return f"{where} does not take {bad}" if bad else ""
    err = missing(help_flags(["./tandem", sub, "--help"]), f"./tandem {sub} --help")
    if err or sub != "generate":
        return err
    binary = "tools/generate_client" if "--router" in [f.split("=")[0] for f in flags] \
        else "engine/runtime/generate"
    return missing(help_flags([binary, "--help"]), binary)


def self_test():
    wrong = [
        "./tandem bench serving --no-such-flag=1",
        "./tandem bench no-such-bench",
        "./tandem no-such-command",
        "./tandem up --no-such-option",
        "./tandem up --prefill x",
        "./tandem generate --router 127.0.0.1:1 --no-such-flag 3",
        "./tandem make-checkpoint --out d --size tiny --no-such-flag",
    ]
    for cmd in wrong:
        if not check(cmd):
            sys.exit(f"FAIL self-test: '{cmd}' passed the check")
    for cmd in ["./tandem bench serving --num-prompts=2 --num_prompts 2",
                "./tandem up --prefill 2 --decode 1",
                "./tandem generate --router 127.0.0.1:1 --prompt x --max-tokens 3"]:
        err = check(cmd)
        if err:
            sys.exit(f"FAIL self-test: '{cmd}': {err}")


def main():
    self_test()
    failures, n = [], 0
    seen = set()
    for path in DOCS:
        for line, cmd in commands_in(path):
            if (path, cmd) in seen:
                continue
            seen.add((path, cmd))
            n += 1
            try:
                err = check(cmd)
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                err = f"could not be checked: {e}"
            print(f"{'ok  ' if not err else 'FAIL'} {path}:{line}: {cmd}")
            if err:
                failures.append(f"{path}:{line}: {cmd}\n    {err}")
    if n < 40:
        failures.append(f"only {n} example commands found: the extraction broke")
    if failures:
        print("\n".join(["", f"{len(failures)} of {n} examples are wrong:"] + failures))
        sys.exit(1)
    print(f"all {n} example commands are accepted")


if __name__ == "__main__":
    main()
