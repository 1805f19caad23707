#!/usr/bin/env bash
# The paper's benchmark suite (Section 6.1, Appendix A) through lm-evaluation-harness, one lm-eval run per group.
#
#   eval_configs/suite/run_suite.sh MODEL_ARGS OUTPUT [GROUP ...]
#
# MODEL_ARGS  lm-eval --model_args, e.g. pretrained=allenai/OLMoE-1B-7B-0924-Instruct,config=eval_configs/runs/olmoe/psr_lam0.3_n1_res50.yaml
# OUTPUT      a folder; group G writes OUTPUT/G/<model>/ (results JSON and per-question samples for the paired statistics)
# GROUP       any of the *.yaml group files beside this script, without .yaml (default: the eight tasks of the
#             paper: mmlu arc_challenge hellaswag gsm8k bbh ifeval humaneval mbpp)
#
# Environment: MODEL (default psr_hf), LM_EVAL (the lm-eval command, default "lm-eval"), BATCH_SIZE (default 1,
# the paper's batch size on OLMoE), DEVICE (lm-eval's default, cuda:0, when unset), DRY_RUN=1 prints the
# commands instead of running them. The datasets and the code_eval metric come from the Hugging Face hub: this
# needs network access (the offline tasks are in eval_configs/tasks).
#
# The code groups (humaneval, mbpp) execute model-generated code through lm-eval's code_eval metric, which has
# no sandbox of its own. This script never allows that for you: it refuses to start while a code group is asked
# for (the default list has two) unless YOU have set HF_ALLOW_CODE_EVAL=1 in your environment, e.g.
#   HF_ALLOW_CODE_EVAL=1 eval_configs/suite/run_suite.sh ARGS OUT humaneval mbpp     (inside a container or VM)
# or leave the code groups out: run_suite.sh ARGS OUT mmlu arc_challenge hellaswag gsm8k bbh ifeval
set -euo pipefail

if [[ $# -lt 2 ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
model_args="$1"
output="$2"
shift 2
groups=("$@")
if [[ ${#groups[@]} -eq 0 ]]; then
    groups=(mmlu arc_challenge hellaswag gsm8k bbh ifeval humaneval mbpp)
fi
read -r -a lm_eval <<< "${LM_EVAL:-lm-eval}"

for group in "${groups[@]}"; do
    config="$here/$group.yaml"
    if [[ ! -f "$config" || "$group" == metrics ]]; then
        echo "run_suite.sh: '$group' is not a group (no group file $config)" >&2
        exit 2
    fi
done

code_groups=()
for group in "${groups[@]}"; do
    if grep -q '^confirm_run_unsafe_code: true' "$here/$group.yaml"; then
        code_groups+=("$group")
    fi
done
if [[ ${#code_groups[@]} -gt 0 && "${HF_ALLOW_CODE_EVAL:-}" != 1 ]]; then
    cat >&2 <<EOF
run_suite.sh: ${code_groups[*]} execute model-generated code (lm-eval's code_eval metric, which runs it with
the rights of your user, network included), and HF_ALLOW_CODE_EVAL is not 1. This script does not opt in for you.
To run them, preferably inside a container or VM, opt in yourself:
    export HF_ALLOW_CODE_EVAL=1
or leave them out of the GROUP list (the default list includes humaneval and mbpp).
EOF
    exit 2
fi

for group in "${groups[@]}"; do
    cmd=("${lm_eval[@]}" run --config "$here/$group.yaml" --model "${MODEL:-psr_hf}" --model_args "$model_args"
         --batch_size "${BATCH_SIZE:-1}" --output_path "$output/$group")
    if [[ -n "${DEVICE:-}" ]]; then
        cmd+=(--device "$DEVICE")
    fi
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${cmd[@]}"
        printf '\n'
    else
        echo "== $group: ${cmd[*]}" >&2
        "${cmd[@]}"
    fi
done
