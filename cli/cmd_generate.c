#include "cli.h"
CLI_CMD(generate) { (void)argc; (void)argv; return cli_fail("generate: not built yet"); }
