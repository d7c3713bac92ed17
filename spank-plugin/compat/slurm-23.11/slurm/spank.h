/* Compile check only: the installed <slurm/spank.h> plus the one call Slurm 23.11 added, so the
 * plugin's 23.11 code path (automatic resume supervisor) is type-checked on hosts with an older
 * Slurm. Used by scripts/test.sh with SLURM_INCLUDE_DIR; never for a plugin that is loaded. */
#include_next <slurm/spank.h>
extern spank_err_t spank_prepend_task_argv(spank_t spank, int argc, const char *argv[]);
