"""Is the Hugging Face Hub within reach? (a probe with a short timeout, so an offline machine fails in a second,
not after half a minute of retries), and the one-line errors of a hub id that cannot be fetched."""

from __future__ import annotations

import os
import threading
from typing import Any

from .errors import MoetoolError, MoetoolRuntimeError, env_seconds, one_line

#: seconds the Hub (or the https proxy in front of it) may take to answer before moetool treats the machine as
#: offline; a slow link raises it with the environment variable ``MOETOOL_HUB_TIMEOUT``
HUB_PROBE_TIMEOUT = 1.5


def _hub_endpoint() -> str:
    """The Hub's base URL: ``HF_ENDPOINT``, default https://huggingface.co."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


_REACHABLE: set[str] = set()  # successes are remembered for the process; failures are probed again


def _probe(url: str, timeout: float) -> str | None:
    """``None`` if ``url`` answers a HEAD request (any HTTP status) within ``timeout`` seconds, else why not.

    urllib honours ``HTTPS_PROXY`` / ``NO_PROXY`` as a download does. DNS resolution cannot be timed out, so the
    request runs in a daemon thread that is abandoned after ``timeout``.
    """
    if url in _REACHABLE:
        return None
    import urllib.error
    import urllib.request

    result: dict[str, str] = {}

    def attempt() -> None:
        try:
            opener = urllib.request.build_opener()  # a fresh one: the proxy settings of now, not of the first call
            opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result["ok"] = ""
        except urllib.error.HTTPError:  # the server answered (404, 401, ...): the network is there
            result["ok"] = ""
        except Exception as e:  # noqa: BLE001 - URLError, timeouts, TLS errors, connection resets
            reason = getattr(e, "reason", e)
            result["error"] = str(reason) or type(reason).__name__

    t = threading.Thread(target=attempt, daemon=True, name="moetool-hub-probe")
    t.start()
    t.join(timeout)
    if "ok" in result:
        _REACHABLE.add(url)
        return None
    return result.get("error", f"no answer within {timeout:g} s")


def hub_offline() -> str | None:
    """Why the Hub must not be contacted (``HF_HUB_OFFLINE`` set, or no answer from it within
    :data:`HUB_PROBE_TIMEOUT` s), or ``None`` when it answers. Offline, models load from the local cache only
    (``local_files_only``): an uncached hub id fails at once instead of after ~30 s of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    url = _hub_endpoint()
    timeout = env_seconds("MOETOOL_HUB_TIMEOUT", HUB_PROBE_TIMEOUT)
    why = _probe(url, timeout)
    if why is None:
        return None
    slow = "; a slow link: raise MOETOOL_HUB_TIMEOUT" if "timed out" in why or "no answer" in why else ""
    return f"cannot reach {url}: {why}{slow}"


def hub_error(source: str, err: Exception, offline: str | None, *, part: str | None = None) -> MoetoolError:
    """The one line of a hub id that cannot be fetched; ``part`` (e.g. ``"weights"``): what was being fetched after
    the config was read -- offline, the line then says the config is cached and that part is not (plan and inspect
    answer from the config; "not in the cache" would contradict them)."""
    last = source.split("/")[-1]
    if offline:
        what = (f"the {part} of '{source}' are not (all) in the local Hugging Face cache (its config is: plan and "
                f"inspect read it)" if part else f"'{source}' is not in the local Hugging Face cache")
        return MoetoolRuntimeError(
            f"{what} and the Hub is out of reach ({offline}): download it "
            f"where there is network (hf download {source}) and pass the folder, e.g. --model /path/to/{last}")
    chain = [err, err.__cause__, err.__context__]
    if any(type(e).__name__ in ("RepositoryNotFoundError", "GatedRepoError") for e in chain if e is not None) \
            or "not a valid model identifier" in str(err):
        return MoetoolRuntimeError(f"the Hugging Face Hub has no model '{source}' that you may read (a typo, or a "
                                   f"gated/private model: log in with `hf auth login`): {one_line(err)}")
    return MoetoolRuntimeError(f"could not fetch '{source}' from the Hugging Face Hub ({one_line(err)})")


def hub_kwargs(kind: str) -> tuple[dict[str, Any], str | None]:
    """``from_pretrained`` keyword arguments for a model of this kind, and why we are offline (hub kinds only)."""
    if kind not in ("hub", "alias"):
        return {}, None
    offline = hub_offline()
    return ({"local_files_only": True} if offline else {}), offline
