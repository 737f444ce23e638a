#include "cli.h"
CLI_CMD(logits) { (void)argc; (void)argv; return cli_fail("logits: not built yet"); }
