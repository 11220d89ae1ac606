"""``manygpu doctor``: facts (probes) -> checks (pure functions) -> report (views).

>>> from manygpu.doctor import gather, run_checks
>>> results = run_checks(gather())
"""

from manygpu.doctor.checks import run_checks
from manygpu.doctor.facts import Facts, LiveResults
from manygpu.doctor.probes import gather
from manygpu.doctor.report import DoctorReport
from manygpu.doctor.result import CheckResult

__all__ = ["CheckResult", "DoctorReport", "Facts", "LiveResults", "gather", "run_checks"]
