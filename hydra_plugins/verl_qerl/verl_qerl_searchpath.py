"""Adds verl-qerl's config groups to every hydra app, so ``python -m verl.trainer.main_ppo +qerl=nvfp4`` works.

The group lives in ``verl_qerl/verl/hydra/qerl/`` (nvfp4, nvfp4_noaqn, bf16, nf4).
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VerlQeRLSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl-qerl", path="pkg://verl_qerl.verl.hydra")
