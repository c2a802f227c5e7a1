"""A PostgreSQL server of quantgate's own, on loopback, with its cluster under QUANTGATE_HOME.

Debian's `postgresql` package provides the binaries (`/usr/lib/postgresql/<v>/bin`, not on PATH by
default). PostgreSQL refuses to run as root: when we are root, the cluster belongs to the package's
`postgres` user and every server command runs as that user. Connections need a password (scram-sha-256,
loopback TCP only, no Unix socket): it is generated at `initdb` and kept in `services/pg.password`.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

DB_USER = "quantgate"
DATABASES = ("prefect", "mlflow")


def find_bindir() -> Path | None:
    """Where `initdb`, `pg_ctl` and `psql` are: PATH first, else the newest Debian cluster version."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                      if p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


def server_user() -> pwd.struct_passwd:
    """Who runs the server: ourselves, or `postgres` (the Debian package's user) when we are root."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root but there is no 'postgres' user to run PostgreSQL as "
                           "(install Debian's postgresql package: apt-get install postgresql)") from None


def _searchable_by(path: Path, user: pwd.struct_passwd) -> bool:
    st = path.stat()
    if user.pw_uid == 0 or st.st_uid == user.pw_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    groups = {user.pw_gid} | {g for g in os.getgrouplist(user.pw_name, user.pw_gid)}
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def grant_path(data_dir: Path, home: Path, user: pwd.struct_passwd) -> list[Path]:
    """Let `user` reach `data_dir`: our own folders (QUANTGATE_HOME and below) get search permission for
    others (x, not r); a folder above QUANTGATE_HOME that blocks it is an error we name, not one we change."""
    granted = []
    home = home.resolve()
    for folder in reversed(data_dir.resolve().parents):
        if _searchable_by(folder, user):
            continue
        if folder == home or home in folder.parents:
            folder.chmod(folder.stat().st_mode | stat.S_IXOTH)
            granted.append(folder)
            continue
        raise RuntimeError(f"PostgreSQL runs as {user.pw_name!r}, which cannot enter {folder} (above QUANTGATE_HOME "
                           f"{home}): set QUANTGATE_HOME to a folder it can reach, or `chmod o+x {folder}`")
    return granted


@dataclass(frozen=True)
class Postgres:
    data_dir: Path
    port: int
    host: str = "127.0.0.1"

    @property
    def password_file(self) -> Path:
        return self.data_dir.parent / "pg.password"

    @property
    def log_file(self) -> Path:
        return self.data_dir.parent / "postgres.log"

    def url(self, database: str, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{DB_USER}:{self.password()}@{self.host}:{self.port}/{database}"

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def _bin(self, name: str) -> str:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        return str(bindir / name)

    def _as_server_user(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        user = server_user()
        as_user = {} if user.pw_uid == os.geteuid() else {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        env = {**os.environ, "HOME": user.pw_dir, "LC_ALL": "C.UTF-8"}
        result = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, **as_user, **kw)
        if check and result.returncode != 0:
            raise RuntimeError(f"{Path(argv[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        return result

    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file() and self.password_file.is_file()

    def init(self, home: Path) -> list[Path]:
        """`initdb` the cluster once (as the server user); returns the folders we opened for that user."""
        if self.initialized():
            return []
        user = server_user()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        granted = grant_path(self.data_dir, home, user)
        os.chown(self.data_dir, user.pw_uid, user.pw_gid)
        self.data_dir.chmod(0o700)
        password = secrets.token_urlsafe(24)
        with tempfile.NamedTemporaryFile("w", dir=self.data_dir.parent, delete=False) as pw:
            pw.write(password + "\n")
        os.chown(pw.name, user.pw_uid, user.pw_gid)
        try:
            self._as_server_user([self._bin("initdb"), "-D", str(self.data_dir), "-U", DB_USER, "-E", "UTF8",
                                  "--auth-host=scram-sha-256", "--auth-local=reject", f"--pwfile={pw.name}",
                                  "--no-instructions"])
        finally:
            os.unlink(pw.name)
        self.password_file.write_text(password + "\n")
        self.password_file.chmod(0o600)
        return granted

    def start(self, timeout_s: int = 60) -> int:
        """Start the postmaster (pg_ctl daemonizes it); returns its pid."""
        if self.log_file.exists() and self.log_file.stat().st_uid != server_user().pw_uid:
            self.log_file.unlink()
        if not self.log_file.exists():
            self.log_file.touch()
            user = server_user()
            os.chown(self.log_file, user.pw_uid, user.pw_gid)
        options = f"-p {self.port} -c listen_addresses={self.host} -c unix_socket_directories=''"
        self._as_server_user([self._bin("pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_file), "-o", options,
                              "-w", "-t", str(timeout_s), "start"])
        self.create_databases()
        return self.pid() or 0

    def pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError, PermissionError):
            return None

    def running(self) -> bool:
        return self._as_server_user([self._bin("pg_ctl"), "-D", str(self.data_dir), "status"], check=False).returncode == 0

    def psql(self, sql: str, database: str = "postgres") -> str:
        env = {**os.environ, "PGPASSWORD": self.password()}
        result = subprocess.run([self._bin("psql"), "-h", self.host, "-p", str(self.port), "-U", DB_USER, "-d", database,
                                 "-tAc", sql], env=env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"psql failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def create_databases(self) -> None:
        existing = set(self.psql("SELECT datname FROM pg_database").split())
        for name in DATABASES:
            if name not in existing:
                self.psql(f'CREATE DATABASE "{name}"')

    def stop(self, timeout_s: int = 30) -> None:
        if self.pid() is None:
            return
        self._as_server_user([self._bin("pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "-t", str(timeout_s),
                              "stop"], check=False)
