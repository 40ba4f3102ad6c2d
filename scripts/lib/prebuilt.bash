# scripts/lib/prebuilt.bash — sourced by the scripts that run binaries of scripts/build-variants on a GPU
# machine (bench-ab, gpu-perf, gpu-check --prebuilt).

# unpack_binary XZ DEST: the executable DEST from the xz-compressed binary XZ.
unpack_binary() { xz -d -c "$1" >"$2" && chmod +x "$2"; }

# pack_results OUT WORK: everything in OUT (but an earlier results.tgz) into OUT/results.tgz, written in
# WORK first so that OUT never holds half an archive (a call cut by its time limit brings back the last
# whole one).
pack_results() { tar -C "$1" --exclude=results.tgz -czf "$2/results.tgz" . && mv "$2/results.tgz" "$1/"; }
