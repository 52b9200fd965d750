"""One build step beyond pyproject.toml: systemd/ (the unit and sysusers.d line that
`layerpy install` writes, kept once, at the top of the source) is copied into the package,
under layerpy/bundled/systemd, where bundle.systemd_dir() finds it in a wheel or the pyz.
An editable install reads the checkout's systemd/ instead.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SYSTEMD = Path(__file__).resolve().parent / "systemd"


class BuildWithSystemdFiles(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            into = Path(self.build_lib) / "layerpy" / "bundled" / "systemd"
            shutil.copytree(SYSTEMD, into, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithSystemdFiles})
