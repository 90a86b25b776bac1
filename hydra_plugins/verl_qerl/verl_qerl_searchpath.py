"""Adds verl-qerl's config groups to every hydra app, so ``python -m verl.trainer.main_ppo +qerl=nvfp4`` works.

The group lives in ``verl_qerl/verl/hydra/qerl/`` (nvfp4, nvfp4_noaqn, bf16, nf4). Composing a command line that
selects it in a verl process where verl did not load our plugin fails here, with the reason
(``verl_qerl.verl.plugin_check``): without the plugin the run would silently be plain verl.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from verl_qerl.verl.plugin_check import check_command_line


class VerlQeRLSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        check_command_line()
        search_path.append(provider="verl-qerl", path="pkg://verl_qerl.verl.hydra")
