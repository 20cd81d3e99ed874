# Turns lib/train/src/cuda/kernels.cu into host C++ for the emulation: the kernel bodies are
# kept verbatim; `k<<<grid, block, 0, s>>>(args);` becomes emuLaunch(grid, block, ...), and
# blocks shrink to 8 threads (the reductions are written for any power of two) so that a
# block is 8 host threads meeting at __syncthreads().
import re
import sys

src, out = sys.argv[1], sys.argv[2]
k = open(src).read()
k = k.replace('constexpr int kThreads = 256;', 'constexpr int kThreads = 8;  // emulation')
assert 'kThreads = 8' in k, 'kThreads not found'
launch = re.compile(r'(\w+)<<<(.*?),\s*(kThreads|1),\s*0,\s*s>>>\((.*?)\);', re.S)
k = launch.sub(lambda m: f'emuLaunch({m.group(2)}, {m.group(3)}, [&] {{ {m.group(1)}({m.group(4)}); }});', k)
assert '<<<' not in k, 'a launch the pattern does not know'
open(out, 'w').write('#include "emu.h"\n' + k)
