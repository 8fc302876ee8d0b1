"""Compile caches another user can write into are never loaded from (functrain/compiler/trust.py, cache.py, package.py).

Tested as the attacker acts: another uid (``setpriv --reuid/--regid --clear-groups``; we are root
here) plants code in a folder the victim's compile would load from, and the victim, a non-root
uid of its own, runs ``ft.compile`` in a child process. Both keep ``CAP_DAC_READ_SEARCH`` only so
that they can read the Python install under ``/root``; it grants no write access. Each child
compiles (tens of seconds on 2 shared cores).
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from functrain.compiler import cache as compile_cache
from functrain.compiler import trust

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTACKER, VICTIM, TEAM = 12345, 12346, 12350

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to act as other users")

# the victim's step: a tiny MLP, compiled the way ft.Trainer compiles it (no cache_dir: inductor's own folder)
CHILD = textwrap.dedent(r"""
    import json, sys, warnings
    import torch
    import functrain as ft
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    apply_fn, params, buffers = ft.functionalize(model)
    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
    batch = (torch.randn(8, 6), torch.randn(8, 1))
    state = step.init(params, buffers)
    kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cstep = ft.compile(step, **kwargs)
        run = cstep.runner(donate=True) if kwargs.get("package") else cstep
        got, _ = run(ft.tree.tree_map(torch.clone, state), batch)
    want, _ = step(state, batch)
    import os
    print(json.dumps({"equal": bool(ft.tree.tree_allclose(got, want, rtol=1e-5, atol=1e-6)),
                      "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                      "built": getattr(cstep._packages, "built", None), "loaded": getattr(cstep._packages, "loaded", None),
                      "warm": getattr(cstep._warm, "loaded", None),
                      "warnings": [str(w.message) for w in caught if "ft.compile" in str(w.message)]}))
""")


@pytest.fixture()
def scratch():
    """A shared sticky folder like /tmp (others can make entries, only owners remove them), with a home per user."""
    d = tempfile.mkdtemp(prefix="ft-trust-", dir="/tmp")
    os.chmod(d, 0o1777)
    for name, uid in (("victim", VICTIM), ("attacker", ATTACKER)):
        os.mkdir(os.path.join(d, name), 0o700)
        os.chown(os.path.join(d, name), uid, uid)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as(uid: int, gid: int, argv: list, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=+dac_read_search",
           "--ambient-caps=+dac_read_search", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")


def _env(scratch: str, who: str, **extra) -> dict:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
            "TMPDIR": scratch, "HOME": os.path.join(scratch, who), "USER": who, "LOGNAME": who, **extra}


def _child(uid, gid, env, *args) -> dict:
    p = _as(uid, gid, [sys.executable, "-c", CHILD, *args], env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


PLANT = textwrap.dedent(r"""
    import os, sys
    marker = sys.argv[2]
    for root, dirs, files in os.walk(sys.argv[1]):
        for name in files:
            if name.endswith(".py"):  # inductor's output code: imported by whoever's compile hits it
                with open(os.path.join(root, name), "a") as f:
                    f.write(f"\nopen({marker!r}, 'w').write('pwned')\n")
    for root, dirs, files in os.walk(sys.argv[1]):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o777)
    os.chmod(sys.argv[1], 0o777)
""")


def test_a_planted_default_inductor_folder_is_not_loaded_from(scratch):
    """Another user pre-creates inductor's default folder of the victim ($TMPDIR/torchinductor_victim), fills it
    with the output code of the victim's own step (they compile the same script into it) with a payload
    appended, and opens it to all (0777). The victim's next compile, ft.compile(step) without cache_dir as
    ft.Trainer does, runs none of it, warns once naming the folder and why, and computes the right step."""
    planted = os.path.join(scratch, "torchinductor_victim")
    marker = os.path.join(scratch, "pwned")
    os.mkdir(planted)
    os.chown(planted, ATTACKER, ATTACKER)
    os.chmod(planted, 0o700)  # the attacker's own while they fill it (so their compile trusts it)
    attacker = _child(ATTACKER, ATTACKER, _env(scratch, "attacker", TORCHINDUCTOR_CACHE_DIR=planted))
    assert attacker["equal"], attacker
    p = _as(ATTACKER, ATTACKER, [sys.executable, "-c", PLANT, planted, marker], _env(scratch, "attacker"))
    assert p.returncode == 0, p.stderr
    assert any(n.endswith(".py") for _, _, files in os.walk(planted) for n in files), "nothing to plant into"
    assert not os.path.exists(marker)

    victim = _child(VICTIM, VICTIM, _env(scratch, "victim"))
    assert not os.path.exists(marker), "the victim ran the code another user planted"
    assert victim["equal"], victim
    private = os.path.join(scratch, "victim", ".cache", "functrain", "torchinductor_victim")
    assert victim["inductor"] == private, victim
    named = [w for w in victim["warnings"] if planted in w]
    assert len(named) == 1, victim["warnings"]
    assert f"belongs to uid {ATTACKER}" in named[0] and private in named[0], named
    info = os.stat(os.path.dirname(private))
    assert info.st_uid == VICTIM and stat.S_IMODE(info.st_mode) == 0o700
    # nor did the victim compile into the planted folder what inductor keeps in its default folder whatever
    # TORCHINDUCTOR_CACHE_DIR says (precompiled headers, included into every kernel): they went private too
    mine = [os.path.join(r, n) for r, ds, fs in os.walk(planted) for n in ds + fs
            if os.lstat(os.path.join(r, n)).st_uid == VICTIM]
    assert not mine, f"the victim wrote into the planted folder: {mine[:5]}"
    assert os.path.isdir(os.path.join(private, "precompiled_headers")), os.listdir(private)


# -- the rule itself, on folders made here (root acting for itself, other uids as owners) --------------------
def test_refused_folders_are_replaced_by_private_ones_with_one_warning_each(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR pointing at folders everyone can write, cache_dir= a team
    folder: each is replaced by a private folder, named once in a warning; nothing is compiled."""
    for name, mode in (("open", 0o777), ("triton", 0o777), ("team", 0o2770)):
        (tmp_path / name).mkdir()
        os.chmod(tmp_path / name, mode)
    code = textwrap.dedent("""
        import json, os, warnings
        from functrain.compiler import cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = cache.use_cache_dir(None)
            again = cache.use_cache_dir(None)
            cache._active = None
            team = cache.use_cache_dir(os.environ["TEAM"])
        print(json.dumps([first, again, team, os.environ["TRITON_CACHE_DIR"], [str(w.message) for w in caught]]))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "open"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FUNCTRAIN_CACHE_DIR": str(tmp_path / "private"),
           "TEAM": str(tmp_path / "team"), "TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    first, again, team, triton, caught = json.loads(p.stdout)
    private = tmp_path / "private"
    assert first == again == str(private / "open") and triton == str(private / "triton"), (first, triton)
    assert team == str(private / "team" / "inductor"), team
    for folder, why in (("open", "writable by everyone"), ("triton", "writable by everyone"),
                        ("team", "writable by its group")):
        named = [w for w in caught if repr(str(tmp_path / folder)) in w]
        assert len(named) == 1 and why in named[0], caught
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700


def test_the_default_folder_is_found_as_inductor_finds_it_without_importing_inductor(tmp_path):
    code = ("import sys, json; from functrain.compiler import cache; mine = cache._default_inductor_dir(); "
            "imported = 'torch._inductor' in sys.modules; "
            "from torch._inductor.runtime.cache_dir_utils import default_cache_dir; "
            "print(json.dumps([mine, default_cache_dir(), imported]))")
    for env in ({"USER": "someone", "LOGNAME": "someone"}, {"USER": "", "LOGNAME": "a/b"}):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path), **env})
        assert p.returncode == 0, p.stderr
        mine, theirs, imported = json.loads(p.stdout)
        assert mine == theirs and not imported, (mine, theirs, imported)


def test_the_rule_names_why_a_folder_is_not_trusted(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o755)
    (ok / "ab").mkdir(mode=0o755)
    (ok / "ab" / "x.py").write_text("")
    assert trust.why_untrusted(str(ok)) is None
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o2770)
    assert "writable by its group" in trust.why_untrusted(str(team))
    # planted: a file of another uid's, a symlink, a reachable subfolder others can write
    os.chown(ok / "ab" / "x.py", ATTACKER, ATTACKER)
    assert f"belongs to uid {ATTACKER}" in trust.why_untrusted(str(ok))
    os.chown(ok / "ab" / "x.py", 0, 0)
    os.symlink("/etc/passwd", ok / "ab" / "link.py")
    assert "symlink" in trust.why_untrusted(str(ok))
    os.unlink(ok / "ab" / "link.py")
    os.chmod(ok / "ab", 0o777)
    assert "writable by everyone" in trust.why_untrusted(str(ok))
    os.chmod(ok, 0o700)  # nobody else can reach ab/ any more: its mode no longer matters
    assert trust.why_untrusted(str(ok)) is None
    os.chmod(ok / "ab", 0o755)
    # the chain: a folder inside a non-sticky folder others can write can be replaced
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    (open_parent / "cache").mkdir(mode=0o700)
    assert "not sticky" in trust.why_untrusted(str(open_parent / "cache"))
    os.chmod(open_parent, 0o1777)
    assert trust.why_untrusted(str(open_parent / "cache")) is None
    # a symlink of another user's on the way
    os.symlink(ok, open_parent / "via")
    os.lchown(open_parent / "via", ATTACKER, ATTACKER)
    assert f"is a symlink of uid {ATTACKER}" in trust.why_untrusted(str(open_parent / "via"))
    assert (f"reached through the symlink {str(open_parent / 'via')!r} of uid {ATTACKER}"
            in trust.why_untrusted(str(open_parent / "via" / "ab")))
    with pytest.raises(ValueError, match="writable by its group"):
        compile_cache.check_private_folder(str(team))


# -- packages: a group-writable team cache, a forged checksum ------------------------------------------------
PAYLOAD_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void payload(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("pwned", f); fclose(f); }
}
"""

SWAP = textwrap.dedent(r"""
    import hashlib, json, os, shutil, subprocess, sys, zipfile
    folder, marker = sys.argv[1], sys.argv[2]
    src = os.path.join(os.path.dirname(marker), "payload.c")
    so = os.path.join(os.path.dirname(marker), "payload.so")
    with open(src, "w") as f:
        f.write(sys.argv[3])
    subprocess.run(["gcc", "-shared", "-fPIC", f"-DMARKER={json.dumps(marker)}", "-o", so, src], check=True)
    payload = open(so, "rb").read()
    for name in os.listdir(folder):
        if not name.endswith(".pt2"):
            continue
        package = os.path.join(folder, name)
        swapped = package + ".swap"
        with zipfile.ZipFile(package) as old, zipfile.ZipFile(swapped, "w") as new:
            members = [m for m in old.infolist()]
            assert any(m.filename.endswith(".so") for m in members), [m.filename for m in members]
            for m in members:  # every shared library in the package becomes the payload
                new.writestr(m, payload if m.filename.endswith(".so") else old.read(m))
        os.replace(swapped, package)
        sidecar = package[:-4] + ".json"
        data = json.load(open(sidecar))
        data["sha256"] = hashlib.sha256(open(package, "rb").read()).hexdigest()  # the checksum, rewritten
        with open(sidecar, "w") as f:
            json.dump(data, f)
    print("swapped")
""")


def _share_with_team(src: str, dst: str) -> None:
    """What a team cache looks like: the owner's files, group TEAM, setgid folders 2770, files 0660."""
    shutil.copytree(src, dst)
    for root, dirs, files in os.walk(dst):
        os.chown(root, VICTIM, TEAM)
        os.chmod(root, 0o2770)
        for name in files:
            os.chown(os.path.join(root, name), VICTIM, TEAM)
            os.chmod(os.path.join(root, name), 0o660)


def test_a_swapped_package_in_a_team_cache_or_with_a_rewritten_checksum_does_not_run(scratch):
    """The victim builds a package in its own cache_dir and shares a copy as a team cache (2770, group TEAM).
    A group member swaps the shared library inside the .pt2 for a payload and rewrites the sidecar's
    SHA-256. The victim's next run on the team cache does not load from it (it is group-writable: warned,
    naming it) and loads its own package from its private folder; and the same forged package copied
    into the victim's own folder is refused too (its checksum is not signed with the victim's key),
    rebuilt, and right. The payload never runs."""
    own = os.path.join(scratch, "victim", ".cache", "functrain", "team")  # where the fallback for ".../team" goes
    env = _env(scratch, "victim")
    first = _child(VICTIM, TEAM, env, json.dumps({"cache_dir": own, "package": True}))
    assert first["built"] == 1 and first["equal"], first
    team = os.path.join(scratch, "shared", "team")
    os.makedirs(os.path.dirname(team))
    os.chmod(os.path.dirname(team), 0o755)
    _share_with_team(own, team)
    marker = os.path.join(scratch, "attacker", "pwned")
    os.chmod(os.path.join(scratch, "attacker"), 0o777)  # the victim's payload run may write the marker there
    p = _as(ATTACKER, TEAM, [sys.executable, "-c", SWAP, os.path.join(team, "packages"), marker, PAYLOAD_C],
            _env(scratch, "attacker"))
    assert p.returncode == 0 and "swapped" in p.stdout, p.stderr[-3000:]

    shared = _child(VICTIM, TEAM, env, json.dumps({"cache_dir": team, "package": True}))
    assert not os.path.exists(marker), "the victim ran the payload from the team cache"
    # (its own package, loaded before any trace from its warm entry, or after the trace: one of the two)
    assert shared["equal"] and shared["loaded"] + shared["warm"] == 1 and shared["built"] == 0, shared
    named = [w for w in shared["warnings"] if team in w]
    assert len(named) == 1 and "writable by its group" in named[0] and own in named[0], shared["warnings"]

    # the forged package (right SHA-256 in its sidecar) in a folder the victim trusts: the HMAC refuses it
    packages = os.path.join(own, "packages")
    for name in os.listdir(os.path.join(team, "packages")):
        dst = os.path.join(packages, name)
        shutil.copyfile(os.path.join(team, "packages", name), dst)
        os.chown(dst, VICTIM, TEAM)
        os.chmod(dst, 0o600)
    forged = _child(VICTIM, TEAM, env, json.dumps({"cache_dir": own, "package": True}))
    assert not os.path.exists(marker), "the victim ran the payload of a package whose checksum was rewritten"
    assert forged["equal"] and forged["built"] == 1 and forged["loaded"] == 0, forged
    assert any("not signed with this user's package key" in w for w in forged["warnings"]), forged["warnings"]
