#!/usr/bin/env python3
"""How fast QEMU can save and restore a guest's memory, three ways (a script, not a test).

dormant's qemu `hibernate` today stops the VM and migrates it to a file
(`migrate file:`), and a resume starts QEMU with `-incoming file:`, which reads
the whole memory image before the guest runs again. This compares that with two
ways QEMU offers to avoid the copy, on the same guest:

  A  today: `migrate file:` / `-incoming file:`
  B  the `mapped-ram` capability (RAM pages at fixed offsets in the file)
  C  guest RAM in a shared file (`memory-backend-file,share=on`) and the
     `x-ignore-shared` capability: the save writes only the device state (the
     RAM already is the file; dormant would fsync it), the restore maps the
     file and the guest faults its pages in as it touches them

No guest OS is needed: a 1 GiB TCG guest (as the tests' VMs) whose RAM a
`loader` device fills with 768 MiB of random data (incompressible, no zero
pages), then idles in the firmware. Each row: the save (stop + migrate, and the
fsync that makes it durable), the restore until the guest runs, and reading
all of its RAM afterwards (what C defers). `cold` rows drop the page cache
before the restore (root only), as after a runner host's reboot.

Usage: scripts/bench-hibernate-methods.py [A B C]   (needs qemu-system-x86_64)
"""
import json, os, shutil, signal, socket, subprocess, sys, tempfile, time

QEMU = shutil.which("qemu-system-x86_64")
MEM_MIB = 1024
FILL_MIB = 768


class Vm:
    def __init__(self, d, mode, incoming):
        self.d, self.mode = d, mode
        self.sock = os.path.join(d, f"{mode}.qmp")
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        machine = "q35" + (",memory-backend=ram0" if mode == "C" else "")
        a = [QEMU, "-machine", machine, "-accel", "tcg,thread=multi", "-cpu", "qemu64",
             "-m", str(MEM_MIB), "-nodefaults", "-display", "none",
             "-qmp", f"unix:{self.sock},server=on,wait=off", "-daemonize",
             "-pidfile", os.path.join(d, f"{mode}.pid")]
        if mode == "C":
            a += ["-object", f"memory-backend-file,id=ram0,size={MEM_MIB}M,"
                  f"mem-path={os.path.join(d, 'C.ram')},share=on"]
        if incoming:
            a += ["-incoming", "defer"]
        else:
            a += ["-device", f"loader,file={os.path.join(d, 'fill.bin')},addr=0x1000000,force-raw=on"]
        self.started = time.monotonic()
        subprocess.run(a, check=True)
        s = socket.socket(socket.AF_UNIX)
        s.connect(self.sock)
        self.f = s.makefile("rw")
        self.f.readline()
        self.ex("qmp_capabilities")

    def ex(self, cmd, args=None):
        self.f.write(json.dumps({"execute": cmd, **({"arguments": args} if args else {})}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise RuntimeError(f"{cmd}: {r['error']}")

    def caps(self):
        cap = {"B": "mapped-ram", "C": "x-ignore-shared"}.get(self.mode)
        if cap:
            self.ex("migrate-set-capabilities", {"capabilities": [{"capability": cap, "state": True}]})

    def quit(self):
        pid = int(open(os.path.join(self.d, f"{self.mode}.pid")).read())
        self.ex("quit")
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def row(d, mode, cold):
    state = os.path.join(d, f"{mode}.state")
    ram = os.path.join(d, "C.ram")
    for p in (state, ram):
        if os.path.exists(p):
            os.unlink(p)
    vm = Vm(d, mode, incoming=False)
    time.sleep(2)  # the reset has copied fill.bin into the guest's RAM
    vm.caps()
    t = time.monotonic()
    vm.ex("stop")
    vm.ex("migrate", {"uri": f"file:{state}"})
    while (st := vm.ex("query-migrate").get("status")) != "completed":
        if st == "failed":
            raise RuntimeError(vm.ex("query-migrate"))
        time.sleep(0.005)
    fsync(state)
    vm.quit()
    if mode == "C":
        fsync(ram)
    save = time.monotonic() - t
    disk = os.stat(state).st_blocks * 512 + (os.stat(ram).st_blocks * 512 if mode == "C" else 0)
    if cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    vm = Vm(d, mode, incoming=True)
    vm.caps()
    vm.ex("migrate-incoming", {"uri": f"file:{state}"})
    while vm.ex("query-status")["status"] not in ("paused", "running"):
        time.sleep(0.005)
    vm.ex("cont")
    restore = time.monotonic() - vm.started
    t = time.monotonic()
    vm.ex("stop")
    vm.ex("pmemsave", {"val": 0, "size": MEM_MIB << 20, "filename": "/dev/null"})
    touch = time.monotonic() - t
    vm.quit()
    print(f"| {mode} | {'cold' if cold else 'warm'} | {save:6.2f} | {restore:6.2f} | {touch:6.2f} | {disk / 2**20:6.0f} |",
          flush=True)


def main():
    if not QEMU:
        sys.exit("bench-hibernate-methods: needs qemu-system-x86_64 (scripts/install-test-deps.sh)")
    modes = sys.argv[1:] or ["A", "B", "C"]
    d = tempfile.mkdtemp(prefix="dormant-bench-hib-")
    try:
        with open(os.path.join(d, "fill.bin"), "wb") as f:
            f.write(os.urandom(FILL_MIB << 20))
        print(f"command: scripts/bench-hibernate-methods.py {' '.join(modes)} "
              f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {MEM_MIB} MiB guest, "
              f"{FILL_MIB} MiB random in RAM, TCG)")
        print("| method | cache | save s | restore to running s | read all RAM after s | on disk MiB |")
        print("|---|---|---|---|---|---|")
        for cold in ([False, True] if os.geteuid() == 0 else [False]):
            for mode in modes:
                row(d, mode, cold)
    finally:
        for p in os.listdir(d):
            if p.endswith(".pid"):
                try:
                    os.kill(int(open(os.path.join(d, p)).read()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
