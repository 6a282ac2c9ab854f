#!/usr/bin/env python3
"""Check that the installed (patched) CRIU dumps and restores TCP sockets; print timings.

Root only.  Usage:  sudo .venv/bin/python gym_fork/criu/install/criu-patches/verify_tcp.py [--reps N] [--criu PATH]
Redis cases need `redis-server` on PATH and the `redis` module in this interpreter; else skipped.

Each case starts a small tree as PID 1 of its own PID namespace (`unshare --pid --fork`, the app
calls setsid()), dumps it with --leave-running while it keeps working, restores copies beside the
running original, and checks that every copy keeps its own, still-working sockets and data:
  tcp-hostnet   python: listener on 127.0.0.1 + an established loopback connection to itself;
                original in the host netns, each copy restored into a fresh `ip netns add` netns
                (--join-ns net:/run/netns/X)
  tcp-ownnet    same app started in its own netns (unshare --net): CRIU dumps the netns and
                creates a new one per restore, no --join-ns needed; also via pycriu RPC
  redis-unix    python + child `redis-server --port 0 --unixsocket PATH`, host netns
  redis-tcp-*   python + child redis on 127.0.0.1:PORT, the python connected over TCP
"""
import argparse, os, shutil, socket, statistics, subprocess, sys, tempfile, time

APP = r'''
import os, socket, sys, time, select, subprocess
os.setsid()
mode, logp, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = open(logp, 'a', buffering=1)
me = os.readlink('/proc/self')          # host pid: /proc is the host's
if mode == 'tcp':
    L = socket.socket(); L.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    L.bind(('127.0.0.1', port)); L.listen()
    C = socket.create_connection(('127.0.0.1', port)); S, _ = L.accept()
    n = 0
    while True:
        if select.select([L], [], [], 0.01)[0]:
            c, _ = L.accept(); c.sendall(f"{os.readlink('/proc/self')} {n}\n".encode()); c.close()
        C.sendall(n.to_bytes(8, 'little'))
        got = b''
        while len(got) < 8: got += S.recv(8 - len(got))
        if int.from_bytes(got, 'little') != n:
            log.write(f"{os.readlink('/proc/self')} MISMATCH {n}\n"); sys.exit(3)
        n += 1
else:
    import redis
    d = os.path.dirname(logp)
    args = ['--port', '0', '--unixsocket', d + '/redis.sock'] if mode == 'redis-unix' else \
           ['--port', str(port), '--bind', '127.0.0.1']
    rlog = open(d + '/redis.log', 'a')
    subprocess.Popen(['redis-server', '--save', '', '--appendonly', 'no', *args],
                     stdin=subprocess.DEVNULL, stdout=rlog, stderr=rlog)
    for _ in range(300):
        try:
            r = redis.Redis(unix_socket_path=d + '/redis.sock') if mode == 'redis-unix' \
                else redis.Redis('127.0.0.1', port)
            r.ping(); break
        except Exception: time.sleep(0.02)
    r.set('owner', 'orig')
    while True:
        v = r.incr('counter')
        log.write(f"{os.readlink('/proc/self')} {v} {r.get('owner').decode()}\n")
        time.sleep(0.01)
'''

PROBE_TCP = ("import socket,sys; print(socket.create_connection(('127.0.0.1',int(sys.argv[1])),"
             "timeout=2).recv(100).decode().strip())")
PROBE_REDIS = ("import redis,sys; r=redis.Redis('127.0.0.1',int(sys.argv[1]),socket_timeout=2);"
               "r.set('owner',sys.argv[2]); print(r.get('counter').decode())")


def sh(*a, **kw):
    return subprocess.run(a, check=True, capture_output=True, text=True, **kw).stdout


class Lab:
    def __init__(self, criu, reps):
        self.criu, self.reps = criu, reps
        self.root = tempfile.mkdtemp(prefix='criu-tcp-')
        self.app = os.path.join(self.root, 'app.py')
        open(self.app, 'w').write(APP)
        self.pids, self.netns, self.results = [], [], []

    def start(self, name, mode, port, ownnet):
        d = os.path.join(self.root, name); os.makedirs(d)
        cmd = [sys.executable, self.app, mode, d + '/app.log', str(port)]
        if ownnet:
            cmd = ['unshare', '--net', '--pid', '--fork', 'sh', '-c',
                   'ip link set lo up && exec "$@"', 'sh', *cmd]
        else:
            cmd = ['unshare', '--pid', '--fork', *cmd]
        out = open(d + '/out.log', 'a')
        u = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        for _ in range(200):
            kids = open(f'/proc/{u.pid}/task/{u.pid}/children').read().split()
            if kids: break
            time.sleep(0.01)
        pid = int(kids[0]); self.pids.append(pid)
        time.sleep(1.0 if mode == 'tcp' else 1.5)
        return d, pid

    def dump(self, pid, img, opts):
        os.makedirs(img)
        t = time.perf_counter()
        subprocess.run([self.criu, 'dump', '-t', str(pid), '-D', img, '-o', 'dump.log', '-v4',
                        '--leave-running', *opts], check=True)
        return (time.perf_counter() - t) * 1000

    def restore(self, img, work, opts, join=None):
        os.makedirs(work)
        extra = []
        if join:
            sh('ip', 'netns', 'add', join); self.netns.append(join)
            sh('ip', '-n', join, 'link', 'set', 'lo', 'up')
            extra = ['--join-ns', f'net:/run/netns/{join}']
        t = time.perf_counter()
        subprocess.run([self.criu, 'restore', '-D', img, '-W', work, '-d', '-o', 'restore.log',
                        '--pidfile', work + '/pid', *opts, *extra], check=True)
        ms = (time.perf_counter() - t) * 1000
        pid = int(open(work + '/pid').read()); self.pids.append(pid)
        return pid, ms

    def in_ns(self, pid, code, *args):
        return sh('nsenter', f'--net=/proc/{pid}/ns/net', sys.executable, '-c', code, *args).strip()

    def record(self, case, dumps, restores):
        med = lambda xs: f"{statistics.median(xs):.0f} ms" if xs else '-'
        self.results.append((case, med(dumps), med(restores), len(restores)))
        print(f"OK {case}: dump {med(dumps)}, restore {med(restores)} ({len(restores)} copies)",
              flush=True)

    def cleanup(self):
        for p in self.pids:
            try: os.kill(p, 9)
            except ProcessLookupError: pass
        time.sleep(0.2)
        for n in self.netns: subprocess.run(['ip', 'netns', 'del', n])
        if self.root: shutil.rmtree(self.root, ignore_errors=True)


def check_tcp(lab, orig, copies, port):
    for p in [orig, *copies]:
        a = lab.in_ns(p, PROBE_TCP, str(port)).split(); time.sleep(0.1)
        b = lab.in_ns(p, PROBE_TCP, str(port)).split()
        assert int(a[0]) == int(b[0]) == p and int(b[1]) > int(a[1]), (p, a, b)


def check_redis_log(d, orig, copies):
    time.sleep(0.5)
    last = {}
    for line in open(d + '/app.log'):
        pid, v, owner = line.split(); last[int(pid)] = (int(v), owner)
    assert last[orig][1] == 'orig', last
    for i, p in enumerate(copies):
        assert last[p][1] == f'copy{i}', (p, last)


def case_tcp(lab, ownnet, lock, rpc=False):
    port = 7100 + len(lab.results)
    name = f"tcp-{'ownnet' if ownnet else 'hostnet'}-lock={lock}" + ('-rpc' if rpc else '')
    d, orig = lab.start(name, 'tcp', port, ownnet)
    opts = ['--tcp-established', '--network-lock', lock]
    dumps, restores, copies = [], [], []
    for i in range(lab.reps):
        img = f'{d}/img{i}'
        if rpc:
            dumps.append(rpc_dump(lab, orig, img, lock))
            pid, ms = rpc_restore(lab, img, f'{d}/w{i}', lock)
            lab.pids.append(pid)
        else:
            dumps.append(lab.dump(orig, img, opts))
            pid, ms = lab.restore(img, f'{d}/w{i}', opts,
                                  join=None if ownnet else f'crtcp{os.getpid()}-{len(lab.netns)}')
        restores.append(ms); copies.append(pid)
    check_tcp(lab, orig, copies, port)
    assert 'MISMATCH' not in open(d + '/app.log').read()
    lab.record(name, dumps, restores)


def case_redis(lab, mode, ownnet):
    port = 6400 + len(lab.results)
    name = f"{mode}-{'ownnet' if ownnet else 'hostnet'}"
    d, orig = lab.start(name, mode, port, ownnet)
    opts = ['--tcp-established', '--network-lock', 'skip'] if mode == 'redis-tcp' else []
    dumps, restores, copies = [], [], []
    # redis-unix: one copy only. The restore re-binds the socket path, so the original's listener
    # is then "deleted" at the next dump, and a copy restored from that image unlinks the path.
    for i in range(1 if mode == 'redis-unix' else lab.reps):
        dumps.append(lab.dump(orig, f'{d}/img{i}', opts))
        join = f'crtcp{os.getpid()}-{len(lab.netns)}' if mode == 'redis-tcp' and not ownnet else None
        pid, ms = lab.restore(f'{d}/img{i}', f'{d}/w{i}', opts, join=join)
        restores.append(ms); copies.append(pid)
        if mode == 'redis-unix':   # the latest restore owns the socket path (re-bound at restore)
            sh('redis-cli', '-s', d + '/redis.sock', 'set', 'owner', f'copy{i}')
    if mode == 'redis-tcp':
        for i, p in enumerate(copies):
            lab.in_ns(p, PROBE_REDIS, str(port), f'copy{i}')
        assert lab.in_ns(orig, "import redis,sys; print(redis.Redis('127.0.0.1',int(sys.argv[1]))"
                         ".get('owner').decode())", str(port)) == 'orig'
    check_redis_log(d, orig, copies)
    lab.record(name, dumps, restores)


def rpc_dump(lab, pid, img, lock):
    import pycriu
    os.makedirs(img)
    c = pycriu.criu(); c.use_binary(lab.criu)
    c.opts.images_dir_fd = fd = os.open(img, os.O_DIRECTORY)
    c.opts.log_file = 'dump.log'; c.opts.log_level = 4
    c.opts.pid = pid; c.opts.leave_running = True; c.opts.tcp_established = True
    c.opts.network_lock = {'iptables': 1, 'nftables': 2, 'skip': 3}[lock]
    t = time.perf_counter()
    try: c.dump()
    finally: os.close(fd)
    return (time.perf_counter() - t) * 1000


def rpc_restore(lab, img, work, lock):
    import pycriu
    os.makedirs(work)
    c = pycriu.criu(); c.use_binary(lab.criu)
    c.opts.images_dir_fd = fd = os.open(img, os.O_DIRECTORY)
    c.opts.work_dir_fd = wfd = os.open(work, os.O_DIRECTORY)
    c.opts.log_file = 'restore.log'; c.opts.log_level = 4
    c.opts.tcp_established = True
    c.opts.network_lock = {'iptables': 1, 'nftables': 2, 'skip': 3}[lock]
    c.opts.rst_sibling = True
    t = time.perf_counter()
    try: pid = c.restore().pid
    finally: os.close(fd); os.close(wfd)
    return pid, (time.perf_counter() - t) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--criu', default=shutil.which('criu') or '/usr/local/sbin/criu')
    ap.add_argument('--reps', type=int, default=3)
    a = ap.parse_args()
    if os.geteuid() != 0: sys.exit('run as root')
    lab = Lab(os.path.abspath(a.criu), a.reps)
    have_redis = shutil.which('redis-server') and shutil.which('redis-cli')
    try: import redis  # noqa: F401
    except ImportError: have_redis = False
    try:
        for lock in ('iptables', 'nftables', 'skip'):
            case_tcp(lab, ownnet=False, lock=lock)
        for lock in ('iptables', 'skip'):
            case_tcp(lab, ownnet=True, lock=lock)
        case_tcp(lab, ownnet=True, lock='skip', rpc=True)
        if have_redis:
            case_redis(lab, 'redis-unix', ownnet=False)
            case_redis(lab, 'redis-tcp', ownnet=False)
            case_redis(lab, 'redis-tcp', ownnet=True)
        else:
            print('SKIP redis cases (need redis-server, redis-cli and the redis module)')
    except BaseException:
        print(f'FAILED; logs kept in {lab.root}', file=sys.stderr)
        lab.root = None
        raise
    finally:
        lab.cleanup()
    print(f"all {len(lab.results)} cases passed")


if __name__ == '__main__':
    main()
