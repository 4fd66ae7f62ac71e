# What the one-run scripts on the GPU machine share (bench/gpu.sh, bench/ab.sh); sourced, with
# `out` set to the folder for each step's output.
#
# The Vulkan loader debs in `.gl/` (the device README's recipe) unpacked where the machine has no
# loader; XDG_RUNTIME_DIR set; `step NAME COMMAND...` runs a command, its output shown and added
# to "$out/NAME.txt", and sets `status` to 1 if it fails.
if [ -d .gl ] && ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
status=0
step() { # name, command...
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee -a "$out/$name.txt" || status=1
}
