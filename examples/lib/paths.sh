# Path helpers the example launch scripts share (sourced by examples/run_default.sh, examples/tiny/grpo.sh and
# examples/qerl/common.sh; defines functions only).

# abs_path PATH: PATH made absolute against the caller's current folder, so that paths a user gives relative to
# where they ran a script stay so after the script changes to the repository.
abs_path() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }

# hydra_path PYTHON PATH: PATH as a hydra override value (verl_qerl.verl.launch.path_value): quoted where hydra would
# misread it (`,` `(` `'` ...) and `${` kept literal for OmegaConf. A plain absolute path is already its own value
# (the same answer path_value gives) and needs no interpreter; any other asks PYTHON, and a failure is named.
hydra_path() {
  if [[ $2 == /* && $2 =~ ^[A-Za-z0-9_/.+@%-]+$ ]]; then printf '%s\n' "$2"; return 0; fi
  local v
  v=$("$1" -c 'import sys; from verl_qerl.verl.launch import path_value; print(path_value(sys.argv[1]))' "$2") \
      && [ -n "$v" ] \
    || { echo "${0##*/}: cannot quote the path '$2' for hydra with $1 (is verl_qerl installed?)" >&2; return 1; }
  printf '%s\n' "$v"
}
